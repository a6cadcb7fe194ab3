"""Fails when a test of the last run is over its size class's limit, also when run alone.

    python .ci/sizes.py        # after python -m pytest -n 2

The run's root conftest.py records every test's time (setup, call and
teardown) and class into pytest's cache; this lists the tests over their
class's limit (conftest.LIMITS: an unmarked test 2 s, a ``slow`` one 60 s).
A time taken under ``-n 2`` depends on what the other process and the
machine did meanwhile (a test of 0.05 s once took 3.5 s in a fresh clone's
run), so each test over its limit is timed again, alone, in one new pytest
process: only a test over its limit both times is an offender. Exits with 1
if there is any, or if no run was recorded.
"""

import importlib.util
import json
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def root_conftest():
    """The root conftest.py, which owns the size classes (not tests/conftest.py)."""
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def alone(nodeids, key):
    """{nodeid: [seconds, class]} of these tests run again in one pytest process, in turn."""
    with tempfile.TemporaryDirectory() as cache:
        subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-q", "-o",
                        f"cache_dir={cache}", *nodeids], cwd=ROOT, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        path = pathlib.Path(cache) / "v" / key
        return json.loads(path.read_text()) if path.exists() else {}


def main():
    conftest = root_conftest()
    limits = conftest.LIMITS
    path = ROOT / ".pytest_cache" / "v" / conftest.SIZES_KEY
    if not path.exists():
        print(f"no recorded run: {path} is missing (run the tests first)")
        return 1
    times = json.loads(path.read_text())
    counts = {size: sum(1 for _, s in times.values() if s == size) for size in limits}
    print(f"{len(times)} tests: {counts['small']} small (at most {limits['small']:.0f} s), "
          f"{counts['slow']} slow (at most {limits['slow']:.0f} s)")
    over = conftest.offenders(times)
    again = alone([nodeid for _, _, nodeid in over], conftest.SIZES_KEY) if over else {}
    offenders = 0
    for seconds, size, nodeid in over:
        # A test the second run did not record counts as over its limit.
        second = again.get(nodeid, [float("inf")])[0]
        verdict = "over" if second > limits[size] else "within"
        offenders += verdict == "over"
        print(f"{seconds:7.1f} s, alone {second:7.1f} s: {verdict} the limit of {size} "
              f"({limits[size]:.0f} s)  {nodeid}")
    if offenders:
        print(f"{offenders} tests over their size class's limit, also alone: mark them slow, "
              "or make them smaller (docs/testing.md)")
    return 1 if offenders else 0


if __name__ == "__main__":
    sys.exit(main())
