"""The public functions (layers 7-8): all-reduce, the other collectives, across
workers, ``CrossDeviceOps`` for ``MirroredStrategy``, and the step model.

Importing the package imports none of its modules.
"""
