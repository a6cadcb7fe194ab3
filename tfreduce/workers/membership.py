"""Who may be in an elastic job: the slots a discovery script offers, and the members.

The launcher's elastic mode (``tfreduce.workers.elastic_launch``) asks
``Slots`` for the usable slots ("host:n", on this machine only) and keeps
the job's members, oldest first, in ``Job``: their ids, their slots,
failures, resting slots, the sizes the job may form and the spares.

Standard library only, like the launcher.
"""

import subprocess
import time

__all__ = ["Job", "Slots", "host"]

_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


class Slots:
    """The slots the job may use: the discovery script's, or MAX on the launcher's host."""

    def __init__(self, args, log):
        self._script, self._log = args.host_discovery_script, log
        self._static = [f"{args.host}:{n}" for n in range(args.workers)]
        self._named = set()  # hosts already named as skipped

    def current(self):
        """list of str slots, "host:n", in the discovery's order."""
        if self._script is None:
            return list(self._static)
        try:
            done = subprocess.run([self._script], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as error:
            self._log(f"host discovery {self._script!r} failed ({error}); no slots this time")
            return []
        slots = []
        for line in done.stdout.split():
            host, _, count = line.rpartition(":")
            if host not in _LOCAL_HOSTS or not count.isdigit():
                if line not in self._named:
                    self._named.add(line)
                    self._log(f"host discovery: {line!r} skipped: this launcher starts "
                              "workers on this machine only ('127.0.0.1:SLOTS')")
                continue
            slots += [f"{host}:{n}" for n in range(int(count))]
        return slots


class Job:
    """The members, in age order, and what the launcher knows of the slots."""

    def __init__(self, args, log):
        self.args, self.log = args, log
        self.members = []  # [worker id, slot, rank in its first generation], oldest first
        self.next_id = 0
        self.failures = {}  # slot -> failures so far
        self.resting = {}  # slot or host -> time it may return
        self.updates = 0  # host updates written
        self.announced = set()  # slots a host update announced (added or removed)
        self.hosts = set()  # the hosts of the last discovery
        self.spares = []  # usable slots the sizes leave unused this generation
        self.available = 0  # usable slots at the last fill

    def ready(self):
        """True when the members are a size the job may form."""
        return len(self.members) in self.sizes()

    def sizes(self):
        """The sizes the job may form, ascending (--worker-counts within MIN..MAX)."""
        counts = self.args.worker_counts or range(1, self.args.workers + 1)
        return [n for n in counts if self.args.min_workers <= n <= self.args.workers]

    def size_for(self, available):
        """The largest size the job may form from `available` workers (0: none)."""
        return max([n for n in self.sizes() if n <= available], default=0)

    def usable(self, slots):
        """The slots of `slots` neither left out nor resting."""
        now = time.monotonic()
        return [s for s in slots if self.failures.get(s, 0) < self.args.blacklist_after
                and self.resting.get(s, 0.0) <= now
                and self.resting.get(host(s), 0.0) <= now]

    def fill(self, slots):
        """Drops members whose slot is gone; adds members for free slots up to the largest
        size the job may form (``size_for``); the usable slots left over are spares."""
        self.hosts = {host(s) for s in slots}
        slots = self.usable(slots)
        self.announced = set()
        self.members = [m for m in self.members if m[1] in slots]
        taken = {m[1] for m in self.members}
        free = [s for s in slots if s not in taken]
        self.available = len(self.members) + len(free)
        size = self.size_for(self.available)
        if size:
            # A size below the survivors': the youngest wait as spares. No
            # size at all: the survivors keep their age while the job waits.
            self.members = self.members[:size]
        for slot in free:
            if len(self.members) >= size:
                break
            self.members.append([self.next_id, slot, len(self.members)])
            self.next_id += 1
        taken = {m[1] for m in self.members}
        self.spares = [s for s in slots if s not in taken] if self.args.worker_counts else []

    def lose(self, index, how):
        """Member `index` failed: it leaves, and its host rests (Horovod's rule), or its slot
        alone when every slot is on one host; after --blacklist-after failures its slot is
        left out."""
        worker_id, slot, _ = self.members.pop(index)
        count = self.failures[slot] = self.failures.get(slot, 0) + 1
        if count >= self.args.blacklist_after:
            self.log(f"slot {slot} failed {count} times (worker {worker_id} {how}): left out "
                     "of the job")
        else:
            rests = host(slot) if len(self.hosts) > 1 else slot
            self.resting[rests] = time.monotonic() + self.args.slot_cooldown


def host(slot):
    """The host of a slot "host:n"."""
    return slot.rpartition(":")[0]
