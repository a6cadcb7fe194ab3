"""The cluster of a multi-worker run: ranks, device names, the worker's server.

A multi-worker run is W processes ("workers"), usually one per machine, each
with its own K devices. They find each other through the standard
``TF_CONFIG`` environment variable (``tfreduce.basis.tf_config``).

``Cluster`` parses and checks it without side effects, so a mistake (no task,
an index out of range, a malformed address) is reported before anything
listens. ``start()`` starts this worker's TensorFlow gRPC server in the TF2
eager context (``start_server()``: for a ``tf.compat.v1.Session``), with
task 0 as the collective group leader; this worker's devices are then named
``/job:worker/replica:0/task:<i>/device:...``, the cross-worker collectives
of ``tfreduce.doors.multiworker`` run over that server, and
``detect_lost_workers()`` names a lost peer (``tfreduce.workers.failures``).

Security: TensorFlow's gRPC server has no authentication and no encryption,
and it listens on every network interface of the machine (``0.0.0.0``),
whatever host TF_CONFIG names. Anyone who can reach its port can run any
operation in the worker. Run a cluster only on a trusted, firewalled network.
"""

import time

import tensorflow as tf
# Private but long-standing TF API, the one MultiWorkerMirroredStrategy uses:
# there is no public way to give the eager context a server.
from tensorflow.python.eager import context

from tfreduce.basis.contract import shard_sizes
from tfreduce.basis.devices import local_name, normalize_device
from tfreduce.basis.tf_config import JOBS, check_port, parse_tf_config
from tfreduce.blocks.collective import (CollectiveKeys, CollectiveOptions, all_reduce,
                                        check_timeout, in_function)
from tfreduce.workers.failures import (WorkerLostError, lost_workers_named, unheard_workers,
                                       unreachable_workers)
from tfreduce.workers.mpi_transport import check_transport, open_transport
from tfreduce.workers.progress import progress
from tfreduce.workers.rounds import CollectiveRounds
from tfreduce.workers.watchdog import stall_seconds_from, start_watchdog

__all__ = ["Cluster", "WorkerLostError", "parse_tf_config", "DEFAULT_TIMEOUT"]

#: Seconds a worker waits, idle, in a collective before it fails (Cluster default):
#: the bound on a live peer that never comes (the watchdog names a frozen one).
DEFAULT_TIMEOUT = 300.0

# Cross-worker instance keys start above the range that
# CollectiveKeys.for_call starts its per-call keys in (1 .. 2**30), so that a
# local collective reduction and the cross-worker one share no key unless a
# single call draws over a billion keys.
_FIRST_CROSS_WORKER_KEY = 2 ** 30 + 1


class Cluster:
    """This worker's view of a multi-worker cluster, and its TF server.

    Constructing a Cluster only checks its arguments; nothing listens until
    ``start()`` (TF2) or ``start_server()`` (``tf.compat.v1``). Every worker
    builds its Cluster from the same cluster spec, so the cross-worker
    collective keys it hands out (``keys``) agree across workers as long as
    every worker builds the same reductions in the same order, which is the
    case when they all run the same program.

    Ranks: the chief (if the spec has one) is rank 0, then the workers in
    index order. Rank 0 leads TF's collective group resolution and, by
    tfreduce's convention, is the only one that writes checkpoints and logs.

    Args:
      cluster_spec: dict mapping "worker" (and optionally "chief") to lists
        of "host:port" addresses, TF_CONFIG's "cluster".
      task_type: str, "worker" or "chief", this process's job.
      task_index: int, this process's index in its job.
      timeout: float seconds > 0; how long this worker waits, idle, in a
        cross-worker collective before DeadlineExceededError. The watchdog
        enforces it (``tfreduce.workers.watchdog``); without one, each op carries it
        (``op_timeout``).
      stall_seconds: float seconds >= 0, or None for $TFREDUCE_STALL_SECONDS
        (default 20): a peer silent this long is named (``tfreduce.workers.watchdog``); 0: off.
      transport: "grpc" (TF's runtime for every collective), "mpi" (the
        Horovod calls' agreement and bytes over MPI, ``tfreduce.workers.
        mpi_transport``; the processes started by mpirun) or "auto" (MPI
        when mpirun started them and mpi4py imports).

    Attributes:
      cluster_spec: dict, a copy of the validated spec.
      task_type: str.
      task_index: int.
      timeout: float seconds.
      keys: CollectiveKeys, the instance keys of cross-worker collectives.
      stall_seconds: float; watchdog: its Watchdog after ``start()``, or None.
      rounds: after ``start()``, the ``CollectiveRounds`` its watchdog reads.
      mpi: after ``start()``, its ``MpiTransport``, or None (gRPC only).

    Raises:
      ValueError, TypeError: as ``parse_tf_config``, a bad timeout, stall_seconds or transport.
    """

    #: False: reductions over this cluster cross workers (a LocalCluster's do not).
    is_local = False

    def __init__(self, cluster_spec, task_type, task_index, timeout=DEFAULT_TIMEOUT,
                 stall_seconds=None, transport="grpc"):
        spec, task_type, task_index = parse_tf_config(
            {"cluster": cluster_spec, "task": {"type": task_type, "index": task_index}})
        self.cluster_spec = spec
        self.task_type = task_type
        self.task_index = task_index
        self.timeout = check_timeout(timeout)
        self.stall_seconds = stall_seconds_from(stall_seconds)
        self.transport = check_transport(transport)
        self.watchdog = self.rounds = self.mpi = None
        self.keys = CollectiveKeys(first_instance_key=_FIRST_CROSS_WORKER_KEY)
        self._tasks = [(job, i) for job in JOBS for i in range(len(spec.get(job, [])))]
        self._mode = None

    def order_after(self, tensors):
        """`tensors` as a list: the next collective follows them (one order on every worker)."""
        return list(tensors)

    def agreed(self, summed, here):
        """True if a flag summed over the workers in the last collective is > 0 (`here`: next)."""
        del here
        return summed > 0

    @property
    def op_timeout(self):
        """float seconds or None: the ``timeout_seconds`` of each cross-worker collective op.

        None while the watchdog bounds the waits: TF's per-op timer holds a
        sleeping thread per op execution for the whole timeout (30,000 at 100
        ops/s and 300 s). Else ``timeout`` (``stall_seconds=0``, ``start_server()``)."""
        return None if self.watchdog is not None or self.num_workers < 2 else self.timeout

    @classmethod
    def from_tf_config(cls, tf_config=None, timeout=DEFAULT_TIMEOUT, stall_seconds=None,
                       transport="grpc"):
        """Builds the Cluster described by TF_CONFIG (None: the environment variable's).

        timeout, stall_seconds and transport: see the class. Returns Cluster;
        raises ValueError, TypeError as ``parse_tf_config``.
        """
        spec, task_type, task_index = parse_tf_config(tf_config)
        return cls(spec, task_type, task_index, timeout=timeout, stall_seconds=stall_seconds,
                   transport=transport)

    def __repr__(self):
        return (f"Cluster({self.describe(self.rank)} of {self.num_workers}, "
                f"timeout={self.timeout:g}s)")

    @property
    def num_workers(self):
        """int W, the number of tasks taking part (chief and workers)."""
        return len(self._tasks)

    @property
    def rank(self):
        """int in 0..W-1, this task's place in the rank order."""
        return self._tasks.index((self.task_type, self.task_index))

    @property
    def is_chief(self):
        """True for rank 0, the task that writes checkpoints and logs."""
        return self.rank == 0

    def task_name(self, rank=None):
        """The TF device prefix of task `rank` (None: this one): "/job:worker/replica:0/task:1"."""
        job, index = self._tasks[self.rank if rank is None else rank]
        return f"/job:{job}/replica:0/task:{index}"

    def address(self, rank=None):
        """The "host:port" of a task (None: this task)."""
        job, index = self._tasks[self.rank if rank is None else rank]
        return self.cluster_spec[job][index]

    def describe(self, rank):
        """A task as messages name it, e.g. "worker 1 (10.0.0.2:2222)"."""
        job, index = self._tasks[rank]
        return f"{job} {index} ({self.cluster_spec[job][index]})"

    def describe_towers(self, towers_per_worker):
        """The run's towers as messages name them, e.g. "4 towers (2 workers x 2)"."""
        workers = self.num_workers
        return f"{workers * towers_per_worker} towers ({workers} workers x {towers_per_worker})"

    def device(self, device, where="device"):
        """Names one of this worker's devices in full.

        ``"/gpu:1"`` on worker 2 becomes ``"/job:worker/replica:0/task:2/
        device:GPU:1"``. Full names keep each worker's ops on its own devices
        and give equal local device lists on different workers different
        collective group keys.

        Args:
          device: str, a device of this worker, with or without its job and
            task ("/job:localhost" is taken as this worker).
          where: str, how to name the device in an error message.

        Returns:
          str, the canonical full device name.

        Raises:
          ValueError: if the string is malformed or names another task.
          TypeError: if it is not a string.
        """
        spec = tf.DeviceSpec.from_string(normalize_device(device, where))
        job, index = self._tasks[self.rank]
        if spec.job in (None, "localhost"):
            if spec.task not in (None, 0) or spec.replica not in (None, 0):
                raise ValueError(
                    f"{where} {device!r} names replica {spec.replica} task "
                    f"{spec.task} of no job; this process is {self.task_name()}")
        elif (spec.job, spec.task if spec.task is not None else index) != (job, index) or (
                spec.replica not in (None, 0)):
            raise ValueError(
                f"{where} {device!r} is not a device of this process, which is "
                f"{self.task_name()} ({self.describe(self.rank)}): a worker "
                f"reduces its own devices; the other workers pass theirs")
        return spec.replace(job=job, replica=0, task=index).to_string()

    def devices(self, devices):
        """``device`` applied to a list; returns the list of full names."""
        return [self.device(d, where=f"devices[{k}]") for k, d in enumerate(devices)]

    def batch_slice(self, batch_size, towers_per_worker):
        """This worker's part of a global batch: (start, stop) indices.

        The global batch of B examples is cut into T = W * K tower shards of
        sizes differing by at most one, the first B % T shards one example
        larger (the split of ``ReplicatedTrainer`` applied to all T towers);
        worker of rank r takes the K consecutive shards ``r*K .. r*K+K-1``. Its
        part, split again over its K towers the same way, gives every tower
        its shard of the global split. Example: B=10, W=2, K=2 gives shards
        3, 3, 2, 2: rank 0 takes (0, 6), rank 1 (6, 10).

        Args:
          batch_size: int B >= W * K, the global batch size.
          towers_per_worker: int K >= 1, the towers of each worker.

        Returns:
          (int, int), start and stop of this worker's examples.

        Raises:
          ValueError: if B < W * K (some tower would get no example) or K < 1.
        """
        if isinstance(towers_per_worker, bool) or not isinstance(towers_per_worker, int) or (
                towers_per_worker < 1):
            raise ValueError(f"towers_per_worker must be an int >= 1, got "
                             f"{towers_per_worker!r}")
        towers = self.num_workers * towers_per_worker
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or (
                batch_size < towers):
            raise ValueError(f"global batch size {batch_size!r} is smaller than the "
                             f"{self.describe_towers(towers_per_worker)}: every tower needs "
                             f"at least one example")
        sizes = shard_sizes(batch_size, towers)
        first = self.rank * towers_per_worker
        start = sum(sizes[:first])
        return start, start + sum(sizes[first:first + towers_per_worker])

    def group_key(self, local_devices):
        """The collective group key of one device per worker.

        Args:
          local_devices: list of str, a device on every worker named without
            its job and task (the same name on each), e.g. ["/device:CPU:0"];
            the group holds that device of every task, in rank order.

        Returns:
          int, the same on every worker.
        """
        members = []
        for rank in range(self.num_workers):
            for d in local_devices:
                members.append(self.task_name(rank) + local_name(d))
        return CollectiveKeys.group_key(members)

    def _session_settings(self, config):
        """Collective settings every server of this cluster needs, into config."""
        config.experimental.collective_group_leader = self.task_name(0)
        # A worker sees only its own devices: it then needs no other worker
        # to be up to start, and never places an op on another worker.
        del config.device_filters[:]
        config.device_filters.append(self.task_name())
        return config

    def session_config(self, config=None):
        """A ``tf.compat.v1.ConfigProto`` for this worker's sessions.

        Args:
          config: ConfigProto to start from (copied, not changed), e.g. one
            with ``device_count={"CPU": K}``; None for an empty one.

        Returns:
          ConfigProto with the collective group leader (rank 0) and a device
          filter that keeps the session on this worker's devices.
        """
        out = tf.compat.v1.ConfigProto()
        if config is not None:
            out.CopyFrom(config)
        return self._session_settings(out)

    def _server_def(self, config):
        return tf.train.ServerDef(
            cluster=tf.train.ClusterSpec(self.cluster_spec).as_cluster_def(),
            job_name=self.task_type, task_index=self.task_index, protocol="grpc",
            default_session_config=config)

    def start(self):
        """Starts this worker's server in the TF2 eager context.

        Call it early, after configuring logical devices and before creating
        tensors or models (it also works later: TF then warns that tensors
        created before may fail). The server lives until the process exits.
        With the watchdog on it returns once every peer's was heard, so one
        that freezes at any point is named (``tfreduce.workers.watchdog``).

        Returns:
          self.

        Raises:
          RuntimeError: if ``start_server()`` was called in this process.
          ValueError: if this task's port cannot be opened.
          WorkerLostError: a peer sent no heartbeat within ``timeout`` (not
            started, or UDP blocked between the hosts; ``stall_seconds=0``
            runs without the watchdog).
        """
        if self._mode == "eager":
            return self
        if self._mode is not None:
            raise RuntimeError("start(): this Cluster already started a "
                               "tf.compat.v1 server with start_server()")
        check_port(self.address(), self.describe(self.rank))
        ctx = context.context()
        # The context's config carries the logical device configuration.
        server_def = self._server_def(self._session_settings(ctx.config))
        ctx.enable_collective_ops(server_def)
        ctx.ensure_initialized()
        self._mode = "eager"
        self.mpi = open_transport(self.transport, self.rank, self.num_workers, self.describe)
        if self.stall_seconds and self.num_workers > 1:  # what its watchdog will read
            self.rounds = CollectiveRounds(self.task_name() + "/device:CPU:0")
        self.watchdog = start_watchdog(self)
        missing = self.watchdog.wait_for_peers(self.timeout) if self.watchdog else []
        if missing:
            raise unheard_workers(self, missing)
        return self

    def start_server(self, config=None):
        """Starts this worker's server for ``tf.compat.v1`` sessions.

        Open sessions on it with
        ``tf.compat.v1.Session(server.target, config=cluster.session_config(config))``
        and build graphs whose ops run on this worker's devices
        (``cluster.devices([...])``).

        Args:
          config: ConfigProto for the server's devices (e.g.
            ``device_count={"CPU": K}``); see ``session_config``.

        Returns:
          tf.distribute.Server, started.

        Raises:
          RuntimeError: if ``start()`` or ``start_server()`` already ran.
          ValueError: if this task's port cannot be opened.
        """
        if self._mode is not None:
            raise RuntimeError(f"start_server(): this Cluster already started a "
                               f"server ({self._mode})")
        check_port(self.address(), self.describe(self.rank))
        server = tf.distribute.Server(
            tf.train.ClusterSpec(self.cluster_spec), job_name=self.task_type,
            task_index=self.task_index, protocol="grpc",
            config=self.session_config(config), start=True)
        self._mode = "session"
        return server

    def finish(self, session=None, linger=0.5):
        """Waits until every worker gets here; call it on each before exiting.

        A worker that exits as soon as its own last collective is done can
        break a peer still finishing it ("Socket closed"). This all-reduces
        a scalar over every worker (once it completes, every earlier
        collective is done everywhere), then waits ``linger`` seconds for the
        answers still on their way. ``ReplicatedTrainer.fit`` ends with it.

        Args:
          session: the ``tf.compat.v1.Session`` on this worker's server
            after ``start_server()``; None after ``start()``.
          linger: float seconds to wait after the barrier.

        Raises:
          WorkerLostError: a worker is lost or does not arrive in time.
          RuntimeError: no server started, or a session is missing/extra.
        """
        if self._mode is None:
            raise RuntimeError("finish(): start the cluster first (start() or "
                               "start_server())")
        if (session is None) != (self._mode == "eager"):
            raise RuntimeError(
                "finish(): pass the tf.compat.v1 Session after start_server(), and "
                "no session after start()")
        device = self.task_name() + "/device:CPU:0"
        group_key = self.group_key(["/device:CPU:0"])
        options = CollectiveOptions(timeout=self.op_timeout)

        def build():
            with tf.name_scope("cluster_finish"), tf.device(device):
                return all_reduce(tf.constant(1, tf.int32), self.num_workers, group_key,
                                  self.keys.instance_key(), options, name="barrier")

        # Told: a peer that ended without it is named (tfreduce.workers.watchdog).
        with self.detect_lost_workers(), progress.within("finish() (the last barrier)"):
            if session is None:
                arrived = in_function(build)
            else:
                with session.graph.as_default():
                    arrived = session.run(build())
        if int(arrived) != self.num_workers:
            raise RuntimeError(
                f"finish(): {int(arrived)} of {self.num_workers} workers reached the "
                f"barrier; every worker must call finish() once, at the same point")
        time.sleep(linger)

    def unreachable_workers(self, probe_timeout=5.0):
        """The ranks (list of int) of the other tasks that do not answer within probe_timeout s.

        Probed as ``failures.unreachable_workers`` says."""
        return unreachable_workers(self, probe_timeout, eager=self._mode == "eager")

    def detect_lost_workers(self, probe_timeout=5.0):
        """Turns the failure of a cross-worker collective into a WorkerLostError.

        Wrap each call that runs collectives (a training step, a broadcast)::

            with cluster.detect_lost_workers():      # tfreduce:
                loss = train_step(x, y)

        After a collective failed because a peer is gone or late
        (``failures.COLLECTIVE_FAILURES``), the peers are probed and the error
        names the ones that do not answer. Other errors pass through unchanged.

        Args:
          probe_timeout: float seconds to wait for each peer's answer.

        Raises:
          WorkerLostError: from the collective's ``tf.errors.OpError``.
        """
        return lost_workers_named(self, probe_timeout)
