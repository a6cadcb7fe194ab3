"""Fails when a test of the last run took longer than its size class allows.

    python tests/sizes.py        # after python -m pytest -n 2 (CI runs both)

The run's root conftest.py records every test's time (setup, call and
teardown) and class into pytest's cache; this lists the tests over
their class's limit (conftest.LIMITS: an unmarked test 2 s, a ``slow``
one 60 s) and exits with 1 if there is any, or if no run was recorded.
"""

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from conftest import LIMITS, SIZES_KEY, offenders  # noqa: E402


def main():
    path = ROOT / ".pytest_cache" / "v" / SIZES_KEY
    if not path.exists():
        print(f"no recorded run: {path} is missing (run the tests first)")
        return 1
    times = json.loads(path.read_text())
    over = offenders(times)
    counts = {size: sum(1 for _, s in times.values() if s == size) for size in LIMITS}
    print(f"{len(times)} tests: {counts['small']} small (at most {LIMITS['small']:.0f} s), "
          f"{counts['slow']} slow (at most {LIMITS['slow']:.0f} s)")
    for seconds, size, nodeid in over:
        print(f"{seconds:7.1f} s  {size} (limit {LIMITS[size]:.0f} s)  {nodeid}")
    if over:
        print(f"{len(over)} tests over their size class's limit: mark them slow, or make them "
              "smaller (docs/testing.md)")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
