"""The faults mode: a fault drill, repeated: is the worker named, and how soon is every process gone?

Each run starts 2 workers of ``tfreduce.bench.faults_worker`` (a
Horovod-style loop that tells tfreduce nothing) under ``tfreduce.launch``
on 127.0.0.1, each in a fresh process, and rank 1 does ``--fault`` at step
``--fault-step``:

- freeze (SIGSTOP): was it named by rank 0's watchdog, and how many
  seconds from the freeze until the launcher (and every worker) had
  ended; the goal is every run named and every process gone within 30 s
  (the default stall bound is 20 s);
- lag (50 ms more per step): at how many steps after the onset the chief
  named it (the goal: within 20);
- vanish (a clean exit while rank 0 waits in an eager all-reduce): named,
  and seconds until the end (the goal: the stall bound plus 10 s);
- clean: no report at all in ``--fault-steps`` steps;
- recover: an elastic job (``--workers 2:3``, ``tfreduce.bench.recovery_worker``:
  the example CNN, committing every ``--commit-every`` steps, in the tape
  or fit loop) loses worker 2 to SIGKILL at the step; the seconds from
  the kill to the survivors' next finished step (the goal: at most 15 s),
  and the commits' share of the steps' time (a commit's time over a
  step's, divided by the steps between commits; the goal: at most 5%);
- cost: what counting the rounds (``tfreduce.workers.rounds``) adds to a
  step: the extra microseconds of a traced step with the counting ops
  against the same step without, in this process (the median of 40
  interleaved pairs of blocks of 500 calls), over the clean loop's step
  time across 2 processes (the goal: under 1%). Without the watchdog
  (``TFREDUCE_STALL_SECONDS=0``) each op carries TF's per-op timeout
  instead, a thread per op execution, which costs far more.

A single run of each is in the test suite; the repeats, which find what
happens one time in six, are here. Seconds are wall time on this host.
"""

import os
import re
import statistics
import subprocess
import sys
import time

from tfreduce.bench.harness import environment
from tfreduce.bench.tables import print_table

__all__ = ["run", "print_result"]

#: The launcher's limit on one run, seconds: a silent hang ends there.
TIMEOUT_S = 240
_NAMED = {
    "freeze": r"tfreduce watchdog: .*worker 1 \S+ has sent no heartbeat",
    "vanish": r"tfreduce watchdog: .*worker 1 \S+ has ended",
    "lag": r"tfreduce watchdog: at step (\d+): worker 1 \S+ lags",
}


def _counting_us(pairs=40, calls=500):
    """Microseconds that a round's counting ops add to a traced step, in this process.

    The step updates a variable, as a training step does (a function with
    no resource update at all runs faster, and pays more for a first one).
    The median, over `pairs` interleaved pairs of blocks of `calls` calls,
    of the block with the counting ops less the block without: a single
    call's time varies by tens of microseconds on a shared host."""
    import tensorflow as tf

    from tfreduce.workers.rounds import CollectiveRounds

    rounds, x = CollectiveRounds("/device:CPU:0"), tf.ones([1024])
    weights = tf.Variable(tf.ones([1024]))

    def step(x, counted):
        y = tf.tanh(x * weights) * 2.0  # stands for a round's collectives
        if counted:
            rounds.mark([x], [y])
        weights.assign_sub(1e-3 * y)  # as a training step applies its update
        return y

    steps = [tf.function(lambda x, c=counted: step(x, c)) for counted in (False, True)]
    for function in steps:
        function(x)
    differences = []
    for _ in range(pairs):
        took = []
        for function in steps:
            start = time.perf_counter()
            for _ in range(calls):
                function(x)
            took.append((time.perf_counter() - start) / calls)
        differences.append(took[1] - took[0])
    return 1e6 * statistics.median(differences)


def _recovery(args, log):
    """One elastic launch of the recovery drill; returns the run's row (dict)."""
    command = [sys.executable, "-m", "tfreduce.launch", "--workers", "2:3", "--slot-cooldown",
               "600", "--timeout", str(TIMEOUT_S), "--preload", "tensorflow", "--",
               sys.executable, "-m", "tfreduce.bench.recovery_worker", "--loop",
               args.fault_loop, "--kill-step", str(args.fault_step), "--steps",
               str(args.fault_steps), "--commit-every", str(args.commit_every)]
    done = subprocess.run(command, capture_output=True, text=True)
    acted = re.search(r"\[worker 2\] act kill ([\d.]+)", done.stdout)
    resumed = re.search(r"\[worker 0\] step 1 \d+ ([\d.]+)", done.stdout)
    cost = re.findall(r"\[worker 0\] cost ([\d.]+) ([\d.]+)", done.stdout)
    row = {"code": done.returncode, "reports": 0, "named": bool(
               re.search(r"\[launch\] worker 2 \(rank 2\) was killed by SIGKILL", done.stderr)),
           "seconds": round(float(resumed.group(1)) - float(acted.group(1)), 2)
           if acted and resumed else None,
           "commit_ms": round(1000 * float(cost[-1][0]), 2) if cost else None,
           "step_ms": round(1000 * float(cost[-1][1]), 2) if cost else None,
           "commit_share": round(float(cost[-1][0]) / float(cost[-1][1]) / args.commit_every, 4)
           if cost else None}
    log(f"  run: {row}")
    return row


def _one(args, log):
    """One launch; returns the run's row (dict)."""
    if args.fault == "recover":
        return _recovery(args, log)
    case = "clean" if args.fault == "cost" else args.fault
    command = [sys.executable, "-m", "tfreduce.launch", "--workers", "2",
               "--timeout", str(TIMEOUT_S), "--", sys.executable, "-m",
               "tfreduce.bench.faults_worker", "--case", case, "--loop", args.fault_loop,
               "--at", str(args.fault_step), "--steps", str(args.fault_steps)]
    env = dict(os.environ)
    env.pop("TFREDUCE_STALL_SECONDS", None)  # the default bound
    start = time.time()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    end = time.time()
    acted = re.search(r"\[worker 1\] act \S+ \d+ ([\d.]+)", done.stdout)
    reports = re.findall(r"tfreduce watchdog: .*", done.stderr)
    named = re.search(_NAMED.get(args.fault, r"$^"), done.stderr)
    loop = re.search(r"\[worker 0\] loop ([\d.]+)", done.stdout)
    row = {"code": done.returncode, "reports": len(reports),
           "named": bool(named), "seconds": round(end - float(acted.group(1)), 1)
           if acted else round(end - start, 1),
           "loop_s": float(loop.group(1)) if loop else None}
    if args.fault == "lag":
        row["steps_after_onset"] = int(named.group(1)) - args.fault_step if named else None
    log(f"  run: {row}")
    return row


def run(args, log):
    """The faults mode; returns the JSON-ready result dict.

    Args:
      args: argparse.Namespace (fault, fault_loop, fault_step, fault_steps, runs).
      log: callable(str), progress lines.

    Returns:
      dict with keys mode, config, runs (one row each: exit code, named,
      seconds from the act to the end, reports, steps after the onset for
      lag), summary (named count, min / median / max seconds) and
      environment.
    """
    log(f"{args.runs} runs of {args.fault} at step {args.fault_step}, the {args.fault_loop} "
        f"loop, 2 workers on 127.0.0.1")
    rows = [_one(args, log) for _ in range(args.runs)]
    seconds = [r["seconds"] for r in rows if r["seconds"] is not None] or [float("nan")]
    summary = {"named": sum(r["named"] for r in rows), "runs": len(rows),
               "false_reports": sum(r["reports"] for r in rows) if args.fault == "clean" else 0,
               "seconds_min": min(seconds), "seconds_median": statistics.median(seconds),
               "seconds_max": max(seconds)}
    if args.fault == "lag":
        after = [r["steps_after_onset"] for r in rows if r["steps_after_onset"] is not None]
        summary["steps_after_onset_max"] = max(after) if after else None
    if args.fault == "recover":
        shares = [r["commit_share"] for r in rows if r["commit_share"] is not None]
        summary["commit_share_median"] = statistics.median(shares) if shares else None
    if args.fault == "cost":
        steps = args.fault_steps - 1  # the loop's time is from the second step on
        step_ms = 1000 * statistics.median(r["loop_s"] for r in rows) / steps
        counting_us = _counting_us()
        summary.update(step_ms=round(step_ms, 3), counting_us=round(counting_us, 2),
                       share=round(counting_us / 1000 / step_ms, 5))
    return {"mode": "faults", "config": {"fault": args.fault, "loop": args.fault_loop,
                                         "step": args.fault_step, "steps": args.fault_steps,
                                         "commit_every": args.commit_every},
            "runs": rows, "summary": summary, "environment": environment()}


def print_result(result, out=None):
    """Prints one line per run and the summary."""
    config, summary = result["config"], result["summary"]
    lag, cost = config["fault"] == "lag", config["fault"] == "cost"
    header = (f"{'run':>4} {'exit':>5} {'named':>6} {'s from act to end':>18} {'reports':>8}"
              + (f" {'named, steps after the onset':>29}" if lag else "")
              + (f" {'loop s':>8}" if cost else ""))
    lines = []
    for i, r in enumerate(result["runs"]):
        line = (f"{i + 1:>4} {r['code']:>5} {'yes' if r['named'] else 'no':>6} "
                f"{float('nan') if r['seconds'] is None else r['seconds']:>18.1f} "
                f"{r['reports']:>8}")
        if lag:
            after = r["steps_after_onset"]
            line += f" {'-' if after is None else after:>29}"
        if cost:
            line += f" {r['loop_s'] or 0:>8.3f}"
        lines.append(line)
    who = ("worker 2 of an elastic job of 3 is killed" if config["fault"] == "recover"
           else f"rank 1 does {config['fault']}")
    print_table(f"faults: {who} at step {config['step']} ({config['loop']} loop, "
                f"{3 if config['fault'] == 'recover' else 2} workers, {config['steps']} steps)",
                header, lines, out)
    print(f"named in {summary['named']} of {summary['runs']} runs; seconds from the act to "
          f"the end: min {summary['seconds_min']:.1f}, median {summary['seconds_median']:.1f}, "
          f"max {summary['seconds_max']:.1f}", file=out)
    if config["fault"] == "recover":
        share = summary.get("commit_share_median")
        print(f"(recover: the seconds are from the kill to the survivors' next step; the "
              f"commits, every {config['commit_every']} steps, take "
              f"{'-' if share is None else f'{100 * share:.1f}%'} of the steps' time)", file=out)
    if cost:
        print(f"counting a round adds {summary['counting_us']:.1f} us to a traced step; a step "
              f"of the loop takes {summary['step_ms']:.2f} ms: {100 * summary['share']:.2f}%",
              file=out)
