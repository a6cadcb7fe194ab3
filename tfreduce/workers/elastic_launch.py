"""The launcher's elastic mode: a job of MIN to MAX workers that goes on as workers come and go.

    tfreduce-launch --workers 2:4 --host-discovery-script ./hosts.sh -- python train.py

runs the job as generations (``tfreduce.workers.generations``): clusters of
a fixed size, each started from the members of the last. A worker that
exits non-zero, is killed or is named frozen by a watchdog leaves the job:
the launcher stops the others at once (their last commits are on disk) and
starts the next generation with the survivors, ranked by age (the oldest
is rank 0), plus workers for free slots up to MAX. Each survivor reads its
commit back and ``hvd.elastic.run`` syncs rank 0's to everyone, so the job
rolls back to its last commit and goes on. Of failures that come together,
the first and those killed by a signal count; a later error is taken for
the collateral of the first (its collective failed).

A failed worker's host sits out for ``--slot-cooldown`` seconds, as
Horovod's blacklist does (its slot alone when every slot is on one host,
since resting that host would end the job), then returns as new slots;
after ``--blacklist-after`` failures a slot is left out for good, and the
launcher says so. ``--reset-limit N`` ends the job after N re-formings.

Slots come from ``--host-discovery-script``, Horovod's format: it prints
one ``host:slots`` line per host, and runs every ``--discovery-interval``
seconds. Slots added, or a member's slot removed, are a host update: the
workers re-form at their next commit (every worker sees it at the same
commit), with the new slots and without the removed ones. Without a script
there are MAX slots on ``--host``. Each worker gets Horovod's
``HOROVOD_HOSTNAME`` (its slot's host) and ``HOROVOD_RANK`` (the rank it
started with). This launcher starts workers on this machine only: a
discovery line for another host is named and skipped (on several machines,
start one job per machine's slots or use a scheduler's launcher).

``--worker-counts 1,2,4`` limits the sizes the job forms (deterministic=True
runs on T = M, M/2, ... towers): slots beyond the size wait as spares.

Below MIN workers the job waits for slots, saying so, for at most
``--elastic-timeout`` seconds, then ends, naming the directory that keeps
the last commits.

Standard library only, like the launcher.
"""

import shutil
import signal
import time

from tfreduce.basis.ports import free_ports
from tfreduce.workers import generations
from tfreduce.workers.membership import Job as _Job, Slots as _Slots, host as _host
from tfreduce.workers.watchdog import EXIT_CODE

__all__ = ["add_arguments", "check_arguments", "run", "size_list", "worker_counts"]

# Seconds between two runs of the discovery script.
DISCOVERY_EVERY = 3.0
_POLL_SECONDS = 0.1
# After a first failure, how long the launcher gathers the others before it judges.
_SETTLE_SECONDS = 1.0


def worker_counts(text):
    """--workers' value: "N" (an int) or "MIN:MAX" (a tuple of two ints).

    Raises:
      ValueError: anything else (argparse names the option).
    """
    if ":" not in text:
        return int(text)
    low, _, high = text.partition(":")
    return int(low), int(high)


def size_list(text):
    """--worker-counts' value: "1,2,4" -> (1, 2, 4), ascending, each >= 1.

    Raises:
      ValueError: not a comma-separated list of positive ints.
    """
    sizes = sorted({int(n) for n in text.split(",")})
    if not sizes or sizes[0] < 1:
        raise ValueError(text)
    return tuple(sizes)


def add_arguments(parser):
    """The elastic options of the launcher's parser."""
    parser.add_argument("--min-workers", type=int, default=None, metavar="MIN",
                        help="elastic: the fewest workers the job goes on with (Horovod's "
                             "--min-np); also --workers MIN:MAX")
    parser.add_argument("--max-workers", type=int, default=None, metavar="MAX",
                        help="elastic: the most workers (Horovod's --max-np)")
    parser.add_argument("--host-discovery-script", default=None, metavar="PATH",
                        help="elastic: a program printing one 'host:slots' line per host "
                             "(Horovod's format)")
    parser.add_argument("--discovery-interval", type=float, default=DISCOVERY_EVERY,
                        metavar="S", help="elastic: seconds between two runs of the discovery")
    parser.add_argument("--reset-limit", type=int, default=None, metavar="N",
                        help="elastic: end the job after N re-formings (Horovod's)")
    parser.add_argument("--elastic-timeout", type=float, default=600.0, metavar="S",
                        help="elastic: how long the job waits below MIN workers")
    parser.add_argument("--slot-cooldown", type=float, default=30.0, metavar="S",
                        help="elastic: how long a slot whose worker failed sits out")
    parser.add_argument("--blacklist-after", type=int, default=3, metavar="N",
                        help="elastic: a slot whose workers failed N times is left out")
    parser.add_argument("--worker-counts", type=size_list, default=None, metavar="N,N,...",
                        help="elastic: the only sizes the job forms (e.g. 1,2,4 for "
                             "deterministic=True); the slots beyond wait as spares")


def check_arguments(parser, args):
    """Resolves --workers, --min-workers and --max-workers into args.workers (the most),
    args.min_workers and args.elastic; parser.error on a bad combination."""
    spread = isinstance(args.workers, tuple)
    low, high = args.workers if spread else (args.workers, args.workers)
    low = args.min_workers if args.min_workers is not None else low
    high = args.max_workers if args.max_workers is not None else high
    args.elastic = (spread or args.min_workers is not None or args.max_workers is not None
                    or args.host_discovery_script is not None)
    if not args.elastic and low < 1:
        parser.error(f"--workers must be >= 1, got {low}")
    if not 1 <= low <= high:
        parser.error(f"the workers must satisfy 1 <= MIN <= MAX, got MIN={low}, MAX={high}")
    if args.elastic and args.restarts:
        parser.error("--restarts is for a fixed-size job; an elastic job (--workers MIN:MAX) "
                     "re-forms after every loss")
    if args.elastic and not args.discovery_interval > 0:
        parser.error(f"--discovery-interval must be > 0 seconds, got {args.discovery_interval}")
    if args.elastic and args.blacklist_after < 1:
        parser.error(f"--blacklist-after must be >= 1, got {args.blacklist_after}")
    if args.worker_counts is not None:
        if not args.elastic:
            parser.error("--worker-counts is for an elastic job (--workers MIN:MAX)")
        if not any(low <= n <= high for n in args.worker_counts):
            parser.error(f"--worker-counts {','.join(map(str, args.worker_counts))} has no size "
                         f"between MIN={low} and MAX={high}")
    args.workers, args.min_workers = high, low


def run(args, interrupted, log, run_start, start, stop_request, agent):
    """Runs the elastic job; returns the launcher's exit code.

    Args:
      args: the launcher's arguments (check_arguments done).
      interrupted: list, the signals the launcher received.
      log: function of str, the launcher's log.
      run_start: float, time.monotonic() when the run began.
      start: function(generation, addresses, environments) -> the launcher's
        workers (``launch._Workers``), environments one dict per worker.
      stop_request: function() -> (code, reason) when a signal or --timeout
        ends the run, else None.
      agent: the launcher's ``workers.agent.Agent`` (the watchdogs' reports).
    """
    directory = generations.make_directory()
    job, slots = _Job(args, log), _Slots(args, log)
    generation, code = 0, 0
    while True:
        job.fill(slots.current())
        code = _wait_for_minimum(job, slots, args, log, stop_request)
        if code is not None:
            _keep(directory, log)
            return code
        workers = _start(job, generation, directory, start, log)
        outcome, code = _supervise(job, workers, slots, directory, log, stop_request,
                                   interrupted, agent)
        if outcome == "done":
            shutil.rmtree(directory, ignore_errors=True)
            log(f"all workers finished after {time.monotonic() - run_start:.1f}s "
                f"({generation} re-forming{'s' if generation != 1 else ''})")
            return 0
        if outcome == "stop":
            _keep(directory, log)
            return code
        generation += 1
        if args.reset_limit is not None and generation > args.reset_limit:
            log(f"--reset-limit {args.reset_limit} reached: the job would re-form once more; it "
                f"ends, and the last commits are kept in {directory}")
            return 1


def _keep(directory, log):
    """A job that ends unfinished: says where its commits are kept, or removes a directory
    that holds none (the job ended before any commit)."""
    if generations.has_commits(directory):
        log(f"the last commits are kept in {directory}")
    else:
        shutil.rmtree(directory, ignore_errors=True)


def _wait_for_minimum(job, slots, args, log, stop_request):
    """None once the job has MIN members; else waits (bounded) and returns an exit code."""
    if job.ready():
        return None
    log(f"{_short(job)}: waiting up to {args.elastic_timeout:g}s for slots")
    deadline = time.monotonic() + args.elastic_timeout
    while time.monotonic() < deadline:
        stop = stop_request()
        if stop:
            log(f"{stop[1]}: stopping")
            return stop[0]
        time.sleep(min(args.discovery_interval, max(0.0, deadline - time.monotonic())))
        job.fill(slots.current())
        if job.ready():
            return None
    log(f"still {_short(job, f' after {args.elastic_timeout:g}s')}: the job ends")
    return 1


def _short(job, after=" available"):
    """Why the job cannot form: "1 worker available, fewer than the minimum 2"."""
    count = f"{job.available} worker{'s' if job.available != 1 else ''}{after}"
    if job.available >= job.args.min_workers:
        return f"{count}, none of --worker-counts {','.join(map(str, job.sizes()))} within them"
    return f"{count}, fewer than the minimum {job.args.min_workers}"


def _start(job, generation, directory, start, log):
    host = job.args.host
    addresses = [f"{host}:{p}" if ":" not in host else f"[{host}]:{p}"
                 for p in free_ports(len(job.members), host)]
    # Horovod's HOROVOD_HOSTNAME and HOROVOD_RANK (the rank a worker started with).
    environments = [{generations.DIR_ENV: directory, generations.ID_ENV: str(worker_id),
                     generations.GENERATION_ENV: str(generation),
                     generations.UPDATES_ENV: str(job.updates),
                     generations.COUNTS_ENV: ",".join(map(str, job.sizes())),
                     "HOROVOD_HOSTNAME": _host(slot),
                     "HOROVOD_RANK": str(first_rank)}
                    for worker_id, slot, first_rank in job.members]
    ids = ", ".join(f"{worker_id} ({slot})" for worker_id, slot, _ in job.members)
    plural = "s" if len(job.members) > 1 else ""
    log(f"generation {generation}: {len(job.members)} worker{plural}, ids {ids}, at "
        f"{', '.join(addresses)}")
    if job.spares:
        log(f"slot{'s' if len(job.spares) > 1 else ''} {', '.join(job.spares)} "
            f"{'wait as spares' if len(job.spares) > 1 else 'waits as a spare'}: the job "
            f"forms only --worker-counts {','.join(map(str, job.sizes()))}")
    return start(generation, addresses, environments)


def _supervise(job, workers, slots, directory, log, stop_request, interrupted, agent):
    """Waits for one generation. Returns ("done", 0), ("stop", code) or ("reform", None)."""
    outcome = ("stop", 1)
    try:
        outcome = _watch(job, workers, slots, directory, log, stop_request, interrupted, agent)
        return outcome
    finally:
        if outcome[0] == "reform":  # the survivors' commits are whole on disk, and one may
            workers.signal_all(signal.SIGKILL)  # wait in a collective with the lost: no grace
        workers.stop(0.0)


def _watch(job, workers, slots, directory, log, stop_request, interrupted, agent):
    """_supervise's loop, until the generation is done, stopped or re-forms."""
    args = job.args
    next_discovery = time.monotonic() + args.discovery_interval
    leaving = None  # when the first worker left to re-form
    while True:
        lost = _lost(job, workers, agent)
        fatal = generations.read_fatal(directory) if lost else None
        if fatal:
            log(f"{fatal}: the job cannot go on at any size; it ends")
            return "stop", 1
        if lost:
            settled = _settled(job, workers, agent, lost)
            codes = [p.poll() for p in workers.procs]
            if all(c is not None and c > 0 and c != generations.RESHAPE_CODE for c in codes):
                # Horovod's rule: the script fails wherever it runs.
                log(f"every worker failed (exit codes {', '.join(map(str, codes))}): the job "
                    "ends")
                return "stop", codes[0]
            for index, how in settled:
                log(f"worker {job.members[index][0]} (rank {index}) {how}: the job "
                    "re-forms from the last commit")
                job.lose(index, how)
            return "reform", None
        codes = [p.poll() for p in workers.procs]
        if all(c is not None for c in codes):
            return ("reform", None) if generations.RESHAPE_CODE in codes else ("done", 0)
        if generations.RESHAPE_CODE in codes:
            leaving = leaving or time.monotonic()
            if time.monotonic() - leaving > args.grace:
                return "reform", None
        stop = stop_request()
        if stop:
            log(f"{stop[1]}: stopping every worker")
            if interrupted:
                workers.signal_all(interrupted[0])
            return "stop", stop[0]
        if time.monotonic() >= next_discovery:
            next_discovery = time.monotonic() + args.discovery_interval
            _discover(job, slots.current(), directory, log)
        time.sleep(_POLL_SECONDS)


def _lost(job, workers, agent):
    """[(member index, how)] of the workers that failed or were named frozen."""
    lost = []
    frozen = {i: by for i, (by, _) in agent.named(workers.addresses).items()}
    for i, proc in enumerate(workers.procs):
        code = proc.poll()
        if i in frozen and code is None:
            workers.signal(i, signal.SIGKILL)
            lost.append((i, f"was named frozen by worker {frozen[i]}'s watchdog"))
        elif code not in (None, 0, generations.RESHAPE_CODE):
            how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
            lost.append((i, how if code != EXIT_CODE else f"{how} (its watchdog)"))
    return lost


def _signal_name(number):
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _settled(job, workers, agent, lost):
    """The members lost, once the failures settled (_SETTLE_SECONDS, or all exited): the
    first found, and those killed by a signal or named frozen meanwhile; a worker whose
    error came later is the collateral of a first death (its collective failed), not
    lost. Latest first."""
    first = dict(lost)
    deadline = time.monotonic() + _SETTLE_SECONDS
    while time.monotonic() < deadline and any(p.poll() is None for p in workers.procs):
        time.sleep(_POLL_SECONDS)
        for i, how in _lost(job, workers, agent):
            code = workers.procs[i].returncode
            if i not in first and (code is None or code < 0 or "frozen" in how):
                first[i] = how
    return sorted(first.items(), reverse=True)


def _discover(job, slots, directory, log):
    """A host update when the discovery adds usable slots (up to MAX) or drops a member's:
    the workers re-form at their next commit, without the dropped ones (as Horovod)."""
    taken = {m[1] for m in job.members}
    gone = [m for m in job.members if m[1] not in slots and m[1] not in job.announced]
    staying = len([m for m in job.members if m[1] in slots])
    pending = len([s for s in job.announced if s not in taken])
    new = [s for s in job.usable(slots) if s not in taken and s not in job.announced]
    # As many as make the next size the job may form (all, up to MAX, by default).
    new = new[:max(job.size_for(staying + pending + len(new)) - staying - pending, 0)]
    if not new and not gone:
        return
    job.updates += 1
    job.announced.update(new + [m[1] for m in gone])
    generations.write_hosts_updates(directory, job.updates)
    if new:
        log(f"slot{'s' if len(new) > 1 else ''} {', '.join(new)} added: the workers re-form "
            "at their next commit")
    for worker_id, slot, _ in gone:
        log(f"slot {slot} is gone from the discovery: worker {worker_id} leaves at the next "
            "commit")
