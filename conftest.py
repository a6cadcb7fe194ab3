"""pytest set-up for the Python blocks of the README and docs/ (pytest-markdown-docs).

A block marked ``python runner:TwoWorkers`` is a multi-worker program: it
runs as two worker processes under ``tfreduce.launch`` on 127.0.0.1, and
fails the test with their output unless both exit with 0. Every other block
runs in the test process, on the logical CPU devices tests/conftest.py makes.
"""

import os
import subprocess
import sys
import tempfile

import pytest
from pytest_markdown_docs._runners import DefaultRunner, register_runner

# MkDocs' hook (mkdocs.yml), not a test module.
collect_ignore = ["docs/_hooks"]


def pytest_collection_modifyitems(items):
    """A block that starts two worker processes is slow: the quick tier leaves it out."""
    for item in items:
        if getattr(item, "runner_name", None) == "TwoWorkers":
            item.add_marker(pytest.mark.slow)


@register_runner()
class TwoWorkers(DefaultRunner):
    """Runs a README block as a program of two workers under the launcher, bounded in time."""

    def runtest(self, test, args, **kwargs):
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "readme_block.py")
            with open(path, "w") as f:
                f.write(test.source)
            command = [sys.executable, "-m", "tfreduce.launch", "--workers", "2",
                       "--timeout", "150", "--", sys.executable, path]
            done = subprocess.run(command, capture_output=True, text=True, timeout=200)
        if done.returncode != 0:
            raise AssertionError(f"the two workers exited with {done.returncode}:\n"
                                 f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
