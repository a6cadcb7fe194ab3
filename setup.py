"""Packaging for tfreduce; nothing is written or downloaded at install time."""

from setuptools import find_packages, setup

setup(
    name="tfreduce",
    version="0.1.0",
    description="Device-placed gradient all-reduce subgraphs (flat, hierarchical, "
                "NCCL, collective) and a replicated trainer for TensorFlow",
    packages=find_packages(include=["tfreduce", "tfreduce.*"]),
    python_requires=">=3.9",
    # tf.summary needs tensorboard, which TF no longer installs itself.
    install_requires=["tensorflow>=2.16", "numpy", "tensorboard"],
    entry_points={
        "console_scripts": [
            "tfreduce-bench = tfreduce.bench:main",
            "tfreduce-launch = tfreduce.launch:main",
        ],
    },
    extras_require={
        # pytest-markdown-docs runs the README's Python blocks; its runner
        # API (conftest.py) is pinned to the minor version tested.
        "test": ["pytest", "pytest-timeout", "pytest-markdown-docs>=0.9,<0.10", "hypothesis",
                 "tensorpack", "scikit-learn", "mlxtend", "matplotlib"],
        "tensorpack": ["tensorpack"],
        "examples": ["scikit-learn", "mlxtend", "matplotlib"],
    },
)
