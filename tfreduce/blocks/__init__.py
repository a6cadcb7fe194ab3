"""Device-placed building blocks (layer 4): sums, broadcasts and splits on named
devices, the one builder of TF collective ops, and the stage contract.

Importing the package imports none of its modules.
"""
