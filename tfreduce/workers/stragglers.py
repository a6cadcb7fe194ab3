"""Who the others wait for: the rule that names a straggler worker or tower.

In synchronous training every step waits for the slowest member. A member
is named when its median time over the last STRAGGLER_STEPS steps is
STRAGGLER_MS beyond the other members' median, and by more than half of
it; a median, so one long pause (a checkpoint, a page fault) is not a
straggler, a member slow in most of its steps is. The watchdog applies the
rule to the workers (from their heartbeats), ``tfreduce.trainer.towertimes``
to a process's towers. Standard library only (the launcher imports the
watchdog without TensorFlow).
"""

import statistics

__all__ = ["REPORT_EVERY", "STRAGGLER_MS", "STRAGGLER_STEPS", "lagging", "median_ms",
           "stragglers", "worker_medians"]

#: Steps whose durations the straggler report compares.
STRAGGLER_STEPS = 20
#: Milliseconds per step the others must wait for a worker to name it a straggler.
STRAGGLER_MS = 20.0
#: Steps between two reports of stragglers.
REPORT_EVERY = 500


def lagging(ms, slower):
    """The members that the others wait for, from each one's milliseconds per step.

    One is named when its time differs from the median of the others' by
    more than STRAGGLER_MS and by more than half of that median, in the
    direction of `slower`. The same rule serves workers (`stragglers`) and
    a process's towers (``tfreduce.trainer.towertimes``).

    Args:
      ms: dict key -> float, each member's median ms over its last steps.
      slower: "higher" (a slow member takes more ms: a tower's compute) or
        "lower" (a slow member spends fewer ms inside its steps: the others
        wait for it inside theirs).

    Returns:
      list of (key, its ms, the others' median, lag ms > 0), by key.

    Raises:
      ValueError: `slower` is neither "higher" nor "lower".
    """
    if slower not in ("higher", "lower"):
        raise ValueError(f"slower must be 'higher' or 'lower', got {slower!r}")
    found = []
    for key, mine in sorted(ms.items()):
        others = [v for k, v in ms.items() if k != key]
        if not others:
            continue
        theirs = statistics.median(others)
        lag = mine - theirs if slower == "higher" else theirs - mine
        if lag > STRAGGLER_MS and lag > theirs / 2:
            found.append((key, mine, theirs, lag))
    return found


def stragglers(medians, rank_names, measure="steps"):
    """The workers the others wait for, from each one's median milliseconds inside its steps.

    A worker slowed outside its steps (input, host, network) spends less
    time inside them: the others wait in their collectives until it comes
    (`lagging` with slower="lower"). So it also waits least inside its
    cross-worker rounds (``tfreduce.workers.rounds``), what a loop that
    tells no steps is measured by.

    Args:
      medians: dict rank -> float, median ms inside the last
        STRAGGLER_STEPS steps (every worker's, this one's included), or
        waiting in the last STRAGGLER_STEPS rounds.
      rank_names: function rank -> str.
      measure: "steps" (time inside each step) or "rounds" (waits in them).

    Returns:
      list of str, one line per straggler (empty when none).
    """
    inside = {"steps": "its steps take {mine:.0f} ms inside, theirs {theirs:.0f} ms",
              "rounds": "it waits {mine:.0f} ms in its cross-worker collectives, they "
                        "{theirs:.0f} ms"}[measure]
    return [f"{rank_names(rank)} lags: the other workers wait about {lag:.0f} ms per step "
            f"for it ({inside.format(mine=mine, theirs=theirs)}, over the last "
            f"{STRAGGLER_STEPS} steps)"
            for rank, mine, theirs, lag in lagging(medians, "lower")]


def worker_medians(num_workers, rank, own, measure, heard, gone):
    """dict rank -> each worker's median ms (None until known), as the heartbeats tell them.

    Args:
      num_workers: int W.
      rank: int, this worker's rank, whose median is `own`.
      own: float or None, this worker's median ms.
      measure: str, what `own` measures ("steps" or "rounds", as in
        `stragglers`): a peer that measures otherwise counts as unknown.
      heard: dict rank -> (time, heartbeat dict with "ms" and "of").
      gone: set of the ranks that said goodbye (unknown).
    """
    medians = {r: None for r in range(num_workers)}
    medians[rank] = own
    for r, (_, beat) in list(heard.items()):
        if r not in gone and beat.get("of", "steps") == measure:
            medians[r] = beat.get("ms")
    return medians


def median_ms(durations):
    """The median of a full window of STRAGGLER_STEPS durations in seconds, in ms.

    A median, not a mean: one long pause (a checkpoint, a page fault) is not
    a straggler; a member slow in most steps is. None before the window fills.
    """
    if len(durations) < STRAGGLER_STEPS:
        return None
    return 1000.0 * statistics.median(durations)
