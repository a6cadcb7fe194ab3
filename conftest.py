"""pytest set-up for the whole run: the size classes, and the README's and docs/' blocks.

Size classes (docs/testing.md): every test's time (setup, call and
teardown) is recorded with its class, ``small`` (unmarked, at most
``LIMITS["small"]`` seconds) or ``slow``, into pytest's cache under
``tfreduce/sizes``; the terminal summary lists the tests over their class's
limit, and ``python .ci/sizes.py``, run by CI after the suite, fails on
those that are over it again when run alone.

Python blocks of the README and docs/ run through pytest-markdown-docs. A
block marked ``python runner:TwoWorkers`` is a multi-worker program: it
runs as two worker processes under ``tfreduce.launch --preload tensorflow``
on 127.0.0.1 (the launcher forked from tests/zygote.py's warm Python), and
fails the test with their output unless both exit with 0. A block marked
``python runner:OwnProcess`` runs in a Python process of its own (it changes
process-wide TensorFlow settings, as ``deterministic=True`` does) and is
marked ``slow``. Every other block runs in the test process, on the logical
CPU devices tests/conftest.py makes; one marked ``python runner:Slow`` is
marked ``slow`` (a whole fit, over 2 s).
"""

import importlib.util
import os
import sys
import tempfile

import pytest
from pytest_markdown_docs._runners import DefaultRunner, register_runner

# MkDocs' hook (mkdocs.yml), not a test module.
collect_ignore = ["docs/_hooks"]


#: The most a test of each size class may take, in seconds (setup, call and
#: teardown together, in the README's `pytest -n 2`).
LIMITS = {"small": 2.0, "slow": 60.0}
SIZES_KEY = "tfreduce/sizes"
_times = {}  # nodeid -> [seconds, size class]


def pytest_runtest_logreport(report):
    """Adds each phase's time to its test (in the xdist controller: every test's)."""
    entry = _times.setdefault(report.nodeid, [0.0, "slow" if "slow" in report.keywords
                                                    else "small"])
    entry[0] += report.duration


def offenders(times):
    """[(seconds, class, nodeid)] of the tests over their class's limit, slowest first."""
    return sorted(((seconds, size, nodeid) for nodeid, (seconds, size) in times.items()
                   if seconds > LIMITS[size]), reverse=True)


def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput") or not _times:
        return  # an xdist worker: the controller has every test's times
    if getattr(session.config, "cache", None) is not None:  # None under -p no:cacheprovider
        session.config.cache.set(SIZES_KEY, _times)


def pytest_terminal_summary(terminalreporter):
    over = offenders(_times)
    if over and not hasattr(terminalreporter.config, "workerinput"):
        terminalreporter.section("tests over their size class's limit")
        for seconds, size, nodeid in over:
            terminalreporter.line(f"{seconds:7.1f} s  {size} (limit {LIMITS[size]:.0f} s)  "
                                  f"{nodeid}")


def pytest_collection_modifyitems(items):
    """A block that starts two worker processes, or is marked Slow, is slow: the quick
    tier leaves it out."""
    for item in items:
        if getattr(item, "runner_name", None) in ("TwoWorkers", "TwoFreshWorkers",
                                                  "ElasticWorkers", "Slow", "OwnProcess"):
            item.add_marker(pytest.mark.slow)


@register_runner()
class Slow(DefaultRunner):
    """Runs a block as any other, in the test process; it is marked slow (over 2 s)."""


def _zygote():
    """tests/zygote.py (a warm Python that forks the launcher), loaded once by path."""
    if "zygote" not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "zygote.py")
        spec = importlib.util.spec_from_file_location("zygote", path)
        sys.modules["zygote"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["zygote"])
    return sys.modules["zygote"]


def _run_block(test, command_before, timeout):
    """Writes a block to a file and runs it under ``command_before``; raises unless it exits 0."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "block.py")
        with open(path, "w") as f:
            f.write(test.source)
        done = _zygote().run([*command_before, sys.executable, path], timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"the block exited with {done.returncode}:\n"
                             f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


@register_runner()
class OwnProcess(DefaultRunner):
    """Runs a block in a Python process of its own, bounded in time."""

    def runtest(self, test, args, **kwargs):
        _run_block(test, [], timeout=300)


@register_runner()
class TwoWorkers(DefaultRunner):
    """Runs a README block as a program of two workers under the launcher, bounded in time."""

    def runtest(self, test, args, **kwargs):
        _run_block(test, [sys.executable, "-m", "tfreduce.launch", "--workers", "2", "--timeout",
                          "150", "--preload", "tensorflow", "--"], timeout=200)


@register_runner()
class ElasticWorkers(DefaultRunner):
    """Runs a block as an elastic job of 2 workers (``--workers 2:2``), bounded in time."""

    def runtest(self, test, args, **kwargs):
        _run_block(test, [sys.executable, "-m", "tfreduce.launch", "--workers", "2:2",
                          "--timeout", "150", "--preload", "tensorflow", "--"], timeout=200)


@register_runner()
class TwoFreshWorkers(DefaultRunner):
    """Runs a block as two workers under the launcher, each a fresh Python (no TensorFlow
    preloaded): for blocks that set the environment before TensorFlow starts."""

    def runtest(self, test, args, **kwargs):
        _run_block(test, [sys.executable, "-m", "tfreduce.launch", "--workers", "2", "--timeout",
                          "200", "--"], timeout=260)
