"""Many small gradients in a few buffers, and the wire's compression (layer 3).

Importing the package imports none of its modules.
"""
