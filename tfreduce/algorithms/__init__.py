"""The all-reduce algorithms as stages on packed buffers (layer 5): flat,
hierarchical, ring, NCCL and collective; the frame that runs them; the registry.

Importing the package imports none of its modules.
"""
