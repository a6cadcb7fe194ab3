"""The K x N contract and what every layer shares (layers 0-2): checking gradients,
groups and device names once; the commands' choices; ``TF_CONFIG``; topologies as data.

Importing the package imports none of its modules.
"""
