"""TF_CONFIG: the cluster description every worker of a multi-worker run reads.

The standard ``TF_CONFIG`` environment variable, the one
MultiWorkerMirroredStrategy reads, names every task of the cluster and this
process's task::

    TF_CONFIG='{"cluster": {"worker": ["host0:2222", "host1:2222"]},
                "task": {"type": "worker", "index": 1}}'

This module parses and checks it (``parse_tf_config``), writes it
(``worker_tf_config``, what the launcher gives each worker) and derives it
from a SLURM job step's variables (``slurm_tf_config``, as TF's
SlurmClusterResolver does) or from the processes ``mpirun`` started
(``mpirun_tf_config``). It uses the standard library only, so that
``python -m tfreduce.launch`` starts without importing TensorFlow.
"""

import json
import os
import re
import socket

from tfreduce.basis.ports import free_ports

__all__ = ["JOBS", "parse_address", "check_cluster_spec", "parse_tf_config",
           "worker_tf_config", "check_port", "slurm_tf_config", "expand_hostlist",
           "expand_tasks_per_node", "SLURM_PORT_BASE", "mpirun_size", "mpirun_tf_config"]

#: The port of a node's first task under SLURM; its task i listens on base + i.
SLURM_PORT_BASE = 8888

# TF_CONFIG jobs that take part in the all-reduce, in rank order: a chief,
# when there is one, is rank 0, as in MultiWorkerMirroredStrategy.
JOBS = ("chief", "worker")

_HOSTNAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")


def parse_address(address, where):
    """Checks one ``host:port`` (or ``[v6]:port``) address; returns (host, port)."""
    if not isinstance(address, str):
        raise TypeError(
            f"{where} must be a 'host:port' string, got {type(address).__name__} "
            f"{address!r}")
    hint = "give 'host:port', e.g. '10.0.0.1:2222' or 'localhost:2222'"
    if "://" in address:
        raise ValueError(f"{where} {address!r} has a scheme: {hint} (no 'grpc://')")
    if address.startswith("["):
        host, sep, port = address[1:].partition("]:")
        valid_host = bool(host) and ":" in host and all(
            c in "0123456789abcdefABCDEF:." for c in host)
    else:
        host, sep, port = address.rpartition(":")
        valid_host = bool(_HOSTNAME.match(host))
    if not sep:
        raise ValueError(f"{where} {address!r} has no port: {hint}")
    if not valid_host:
        raise ValueError(f"{where} {address!r} has no valid host name or IP before "
                         f"the port: {hint}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{where} {address!r}: port {port!r} is not a number in "
                         f"1..65535: {hint}")
    return host, int(port)


def check_cluster_spec(spec):
    """Validates the ``cluster`` part of TF_CONFIG; returns a clean copy."""
    if not isinstance(spec, dict):
        raise TypeError(
            f"TF_CONFIG 'cluster' must map job names to lists of 'host:port' "
            f"addresses, e.g. {{\"worker\": [\"host0:2222\", \"host1:2222\"]}}, got "
            f"{type(spec).__name__} {spec!r}")
    others = sorted(set(spec) - set(JOBS))
    if others:
        raise ValueError(
            f"TF_CONFIG cluster has jobs {others}; tfreduce's synchronous "
            f"all-reduce runs among 'worker' tasks (and at most one 'chief'), "
            f"so remove them (parameter servers and evaluators take no part)")
    clean = {}
    seen = {}
    for job in JOBS:
        if job not in spec:
            continue
        addresses = spec[job]
        if isinstance(addresses, str) or not isinstance(addresses, (list, tuple)):
            raise TypeError(
                f"TF_CONFIG cluster[{job!r}] must be a list of 'host:port' "
                f"addresses, got {type(addresses).__name__} {addresses!r}")
        if not addresses:
            raise ValueError(f"TF_CONFIG cluster[{job!r}] is empty: list one "
                             f"address per {job} task or leave the job out")
        if job == "chief" and len(addresses) != 1:
            raise ValueError(
                f"TF_CONFIG cluster['chief'] lists {len(addresses)} addresses "
                f"{list(addresses)!r}; a cluster has at most one chief")
        for i, address in enumerate(addresses):
            where = f"TF_CONFIG cluster[{job!r}][{i}]"
            host, port = parse_address(address, where)
            key = (host.lower(), port)
            if key in seen:
                raise ValueError(
                    f"{where} {address!r} is the address of {seen[key]} too: "
                    f"every task needs its own host:port")
            seen[key] = f"{job} {i}"
        clean[job] = list(addresses)
    if not clean:
        raise ValueError(
            "TF_CONFIG cluster lists no 'worker' (or 'chief') tasks: give e.g. "
            "{\"worker\": [\"host0:2222\", \"host1:2222\"]}")
    return clean


def parse_tf_config(tf_config=None):
    """Parses and checks a TF_CONFIG, before anything is started.

    Args:
      tf_config: the TF_CONFIG as a JSON string or a dict; None reads the
        ``TF_CONFIG`` environment variable.

    Returns:
      (cluster_spec, task_type, task_index): a dict mapping "worker" (and
      "chief", if present) to lists of "host:port" strings, the str job of
      this task and its int index in that job.

    Raises:
      ValueError: TF_CONFIG unset or not JSON; no "cluster" or "task"; a job
        other than "worker" and "chief"; more than one chief; an empty job; a
        malformed or repeated address; a task type not in the cluster or an
        index out of range; an "rpc_layer" other than "grpc".
      TypeError: a part of TF_CONFIG has the wrong JSON type (the task index
        must be an int, the addresses strings).
    """
    if tf_config is None:
        tf_config = os.environ.get("TF_CONFIG", "")
        if not tf_config.strip():
            raise ValueError(
                "TF_CONFIG is not set: on each host set it to the cluster and this "
                "host's task, e.g. TF_CONFIG='{\"cluster\": {\"worker\": "
                "[\"host0:2222\", \"host1:2222\"]}, \"task\": {\"type\": \"worker\", "
                "\"index\": 0}}', or try it on one machine with "
                "'python -m tfreduce.launch --workers 2 -- python your_script.py'")
    if isinstance(tf_config, str):
        try:
            tf_config = json.loads(tf_config)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"TF_CONFIG is not valid JSON ({e.msg} at line {e.lineno} column "
                f"{e.colno}): {tf_config[:200]!r}") from None
    if not isinstance(tf_config, dict):
        raise TypeError(f"TF_CONFIG must be a JSON object with 'cluster' and 'task', "
                        f"got {type(tf_config).__name__} {tf_config!r}")
    if "cluster" not in tf_config:
        raise ValueError(f"TF_CONFIG has no 'cluster' (keys: {sorted(tf_config)}): "
                         f"give the addresses of all workers")
    spec = check_cluster_spec(tf_config["cluster"])
    rpc_layer = tf_config.get("rpc_layer", "grpc") or "grpc"
    if rpc_layer != "grpc":
        raise ValueError(f"TF_CONFIG rpc_layer {rpc_layer!r} is not supported; "
                         f"TF's collectives run over 'grpc'")
    task = tf_config.get("task")
    if task is None:
        raise ValueError(
            f"TF_CONFIG has no 'task': say which of the cluster's tasks this process "
            f"is, e.g. \"task\": {{\"type\": \"worker\", \"index\": 0}} (the cluster "
            f"is {spec})")
    if not isinstance(task, dict):
        raise TypeError(f"TF_CONFIG 'task' must be an object like {{\"type\": "
                        f"\"worker\", \"index\": 0}}, got {task!r}")
    for field in ("type", "index"):
        if field not in task:
            raise ValueError(f"TF_CONFIG task {task!r} has no {field!r}: give e.g. "
                             f"{{\"type\": \"worker\", \"index\": 0}}")
    task_type, index = task["type"], task["index"]
    if task_type not in spec:
        raise ValueError(f"TF_CONFIG task type {task_type!r} is not a job of the "
                         f"cluster, which has {sorted(spec)}")
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(f"TF_CONFIG task index must be an int, got "
                        f"{type(index).__name__} {index!r}")
    count = len(spec[task_type])
    if not 0 <= index < count:
        raise ValueError(
            f"TF_CONFIG task index {index} is out of range: the cluster has {count} "
            f"{task_type} task{'s' if count != 1 else ''} (indices 0..{count - 1})")
    return spec, task_type, index


def worker_tf_config(addresses, index):
    """The TF_CONFIG JSON of worker ``index`` in a cluster of ``addresses``."""
    return json.dumps({"cluster": {"worker": list(addresses)},
                       "task": {"type": "worker", "index": index}})


def check_port(address, task):
    """Checks that the port of this task's ``address`` can be opened here.

    TF's gRPC server listens on 0.0.0.0:port whatever the host, and reports
    a taken port only as "Could not start gRPC server".

    Args:
      address: str, this task's "host:port" in TF_CONFIG.
      task: str, the task as messages name it, e.g. "worker 1 (h:2222)".

    Raises:
      ValueError: another process holds the port.
    """
    port = parse_address(address, "address")[1]
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # As gRPC does: a port whose last connections linger in TIME_WAIT is free.
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind(("0.0.0.0", port))
    except OSError as e:
        raise ValueError(
            f"{task}: port {port} cannot be opened on this host ({e.strerror}): another "
            f"process holds it; free it or give this task another port in TF_CONFIG") from None
    finally:
        probe.close()


def _split_outside_brackets(text):
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def expand_hostlist(text):
    """SLURM's compressed host list as a list: "n[01-03,7],gpu" -> n01, n02, n03, n7, gpu.

    Raises:
      ValueError: unbalanced brackets or a range that is not "a-b" of numbers.
    """
    hosts = []
    for item in _split_outside_brackets(text):
        if "[" not in item:
            hosts.append(item)
            continue
        prefix, _, rest = item.partition("[")
        ranges, closed, suffix = rest.partition("]")
        if not closed:
            raise ValueError(f"SLURM host list {text!r}: '[' without ']' in {item!r}")
        for part in ranges.split(","):
            first, dash, last = part.partition("-")
            if not first.isdigit() or (dash and not last.isdigit()):
                raise ValueError(f"SLURM host list {text!r}: {part!r} is not a number or "
                                 "a range a-b")
            for number in range(int(first), int(last if dash else first) + 1):
                hosts += [prefix + str(number).zfill(len(first)) + tail
                          for tail in expand_hostlist(suffix)] if suffix else [
                    prefix + str(number).zfill(len(first))]
    return hosts


def expand_tasks_per_node(text):
    """SLURM's tasks per node as a list: "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ValueError(f"SLURM tasks per node {text!r}: {part!r} is not N or N(xM)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_tf_config(environ=None, port_base=SLURM_PORT_BASE):
    """The TF_CONFIG of this task of a SLURM job step, or None outside SLURM.

    Reads the variables ``srun`` sets for a job step: SLURM_PROCID (this
    task's rank), SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST and
    SLURM_STEP_TASKS_PER_NODE (not the job's: a batch script's shell has
    SLURM_PROCID=0 and the job's variables, but no step to join). The tasks
    are numbered node by node (SLURM's block distribution, checked against
    SLURM_NODEID when set), task i of a node listening on port_base + i, as
    TF's SlurmClusterResolver assigns them.

    Args:
      environ: mapping, the environment (None: os.environ).
      port_base: int, the port of each node's first task.

    Returns:
      dict, a TF_CONFIG for ``parse_tf_config``; None when SLURM_PROCID is
      unset, or set without a job step (a batch script's shell).

    Raises:
      ValueError: a variable malformed, task counts that disagree with
        SLURM_STEP_NUM_TASKS (both named), or a task on another node than
        block distribution puts it (srun --distribution=block).
    """
    environ = os.environ if environ is None else environ
    names = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST",
             "SLURM_STEP_TASKS_PER_NODE")
    if not all(environ.get(name) for name in names):
        return None
    rank, total = int(environ["SLURM_PROCID"]), int(environ["SLURM_STEP_NUM_TASKS"])
    nodes = expand_hostlist(environ["SLURM_STEP_NODELIST"])
    tasks = expand_tasks_per_node(environ["SLURM_STEP_TASKS_PER_NODE"])
    if len(tasks) != len(nodes) or sum(tasks) != total:
        raise ValueError(f"SLURM's {len(nodes)} nodes {nodes} with tasks per node {tasks} do "
                         f"not give SLURM_STEP_NUM_TASKS={total} tasks")
    owners = [node for node, count in enumerate(tasks) for _ in range(count)]
    if environ.get("SLURM_NODEID") and int(environ["SLURM_NODEID"]) != owners[rank]:
        raise ValueError(f"SLURM task {rank} runs on node {environ['SLURM_NODEID']}, where "
                         f"block distribution puts it on node {owners[rank]}: start the "
                         "tasks with srun --distribution=block")
    workers = [f"{host}:{port_base + i}" for host, count in zip(nodes, tasks)
               for i in range(count)]
    return {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}


def mpirun_size(environ=None):
    """The number of processes ``mpirun`` started with this one, or None outside mpirun.

    Reads Open MPI's OMPI_COMM_WORLD_SIZE, or PMI_SIZE (MPICH, Intel MPI).

    Raises:
      ValueError: the variable is not an int.
    """
    environ = os.environ if environ is None else environ
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if environ.get(name):
            try:
                return int(environ[name])
            except ValueError:
                raise ValueError(f"{name}={environ[name]!r} is not a number of "
                                 "processes") from None
    return None


def mpirun_tf_config(comm):
    """The TF_CONFIG of this process among those of an MPI communicator (mpi4py's).

    The processes all-gather their host names over MPI; the first process on
    each host picks distinct free ports for that host's processes, and those
    are all-gathered too: rank r of the communicator is worker r. When all
    share one host, the addresses are 127.0.0.1 (the cluster stays on
    loopback); otherwise each host's name as ``socket.gethostname()`` gives it.

    Args:
      comm: an mpi4py communicator (Get_rank, allgather), e.g. MPI.COMM_WORLD.

    Returns:
      dict, a TF_CONFIG for ``parse_tf_config``.
    """
    rank, names = comm.Get_rank(), comm.allgather(socket.gethostname())
    hosts = ["127.0.0.1"] * len(names) if len(set(names)) == 1 else names
    on_host = {}
    for r, name in enumerate(names):
        on_host.setdefault(name, []).append(r)
    mine = on_host[names[rank]]
    chosen = comm.allgather(free_ports(len(mine), hosts[rank]) if rank == mine[0] else None)
    ports = [chosen[on_host[name][0]][on_host[name].index(r)] for r, name in enumerate(names)]
    return {"cluster": {"worker": [f"{h}:{p}" for h, p in zip(hosts, ports)]},
            "task": {"type": "worker", "index": rank}}
