"""Fails when a test of the last run took longer than its size class allows.

    python .ci/sizes.py        # after python -m pytest -n 2

The run's root conftest.py records every test's time (setup, call and
teardown) and class into pytest's cache; this lists the tests over
their class's limit (conftest.LIMITS: an unmarked test 2 s, a ``slow``
one 60 s) and exits with 1 if there is any, or if no run was recorded.
"""

import importlib.util
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def root_conftest():
    """The root conftest.py, which owns the size classes (not tests/conftest.py)."""
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    conftest = root_conftest()
    limits = conftest.LIMITS
    path = ROOT / ".pytest_cache" / "v" / conftest.SIZES_KEY
    if not path.exists():
        print(f"no recorded run: {path} is missing (run the tests first)")
        return 1
    times = json.loads(path.read_text())
    over = conftest.offenders(times)
    counts = {size: sum(1 for _, s in times.values() if s == size) for size in limits}
    print(f"{len(times)} tests: {counts['small']} small (at most {limits['small']:.0f} s), "
          f"{counts['slow']} slow (at most {limits['slow']:.0f} s)")
    for seconds, size, nodeid in over:
        print(f"{seconds:7.1f} s  {size} (limit {limits[size]:.0f} s)  {nodeid}")
    if over:
        print(f"{len(over)} tests over their size class's limit: mark them slow, or make them "
              "smaller (docs/testing.md)")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
