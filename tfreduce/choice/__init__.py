"""The communication choice (layer 6): ``tfreduce.Reduction``, and the stage that
builds each group's collective.

Importing the package imports none of its modules.
"""
