"""Packaging for tfreduce; nothing is written or downloaded at install time."""

from setuptools import find_packages, setup

setup(
    name="tfreduce",
    version="0.1.0",
    description="Device-placed gradient all-reduce subgraphs (flat, hierarchical, ring, "
                "NCCL, collective) and a replicated trainer for TensorFlow",
    packages=find_packages(include=["tfreduce", "tfreduce.*"]),
    python_requires=">=3.10",
    # tf.summary needs tensorboard, which TF no longer installs itself.
    install_requires=["tensorflow>=2.16", "numpy", "tensorboard"],
    entry_points={
        "console_scripts": [
            "tfreduce-bench = tfreduce.bench:main",
            "tfreduce-launch = tfreduce.launch:main",
        ],
    },
    extras_require={
        # pytest-markdown-docs runs the Python blocks of the README and
        # docs/; its runner API (conftest.py) is pinned to the minor version
        # tested. mkdocs and mkdocstrings build the manual (tests/test_docs.py).
        # pytest-xdist runs the suite in two processes (README: pytest -n 2).
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "pytest-markdown-docs>=0.9,<0.10",
                 "hypothesis", "tensorpack", "scikit-learn", "mlxtend", "matplotlib",
                 "mkdocs>=1.6", "mkdocstrings[python]>=0.26", "tf-keras"],
        "tensorpack": ["tensorpack"],
        # Keras 2 (tf_keras), for models and optimizers of it (docs/training.md).
        "keras2": ["tf-keras"],
        "examples": ["scikit-learn", "mlxtend", "matplotlib"],
        # mpirun's processes find each other over MPI (needs an MPI, e.g.
        # Debian's openmpi-bin and libopenmpi-dev, to build).
        "mpi": ["mpi4py"],
    },
)
