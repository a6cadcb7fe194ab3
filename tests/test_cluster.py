"""TF_CONFIG parsing, the cluster's topology helpers and failure reporting.

Nothing here starts a TF server: every bad TF_CONFIG must be reported before
anything listens, and the servers themselves are exercised by the
multi-process tests in test_multiworker.py.
"""

import json
import re
import socket

import pytest
import tensorflow as tf

from tfreduce.workers.cluster import DEFAULT_TIMEOUT, Cluster, WorkerLostError, parse_tf_config
from tfreduce.workers.failures import unheard_workers

TWO = {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}


def config(cluster=None, task=None, **extra):
    out = {"cluster": TWO if cluster is None else cluster,
           "task": {"type": "worker", "index": 0} if task is None else task}
    out.update(extra)
    return json.dumps(out)


def listening_socket():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def closed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ------------------------------------------------------------------ parsing

def test_parse_from_environment(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", config(task={"type": "worker", "index": 1}))
    spec, task_type, index = parse_tf_config()
    assert spec == TWO and (task_type, index) == ("worker", 1)
    cluster = Cluster.from_tf_config(timeout=7)
    assert (cluster.num_workers, cluster.rank, cluster.is_chief) == (2, 1, False)
    assert cluster.timeout == 7.0
    assert cluster.task_name() == "/job:worker/replica:0/task:1"
    assert cluster.address() == "127.0.0.1:2223"
    assert repr(cluster) == "Cluster(worker 1 (127.0.0.1:2223) of 2, timeout=7s)"


def test_chief_is_rank_zero():
    spec = {"chief": ["host-a:1000"], "worker": ["host-b:1000", "[::1]:1001"]}
    chief = Cluster(spec, "chief", 0)
    worker = Cluster.from_tf_config(config(spec, {"type": "worker", "index": 1}))
    assert (chief.rank, chief.is_chief, worker.rank, worker.is_chief) == (0, True, 2, False)
    assert [worker.describe(r) for r in range(3)] == [
        "chief 0 (host-a:1000)", "worker 0 (host-b:1000)", "worker 1 ([::1]:1001)"]
    assert worker.task_name(0) == "/job:chief/replica:0/task:0"


def test_building_a_cluster_listens_on_nothing():
    port = closed_port()
    Cluster.from_tf_config(config({"worker": [f"127.0.0.1:{port}"]}))
    probe = socket.socket()
    probe.bind(("0.0.0.0", port))  # still free
    probe.close()


BAD_CONFIGS = [
    ("", ValueError, "TF_CONFIG is not set: on each host set it"),
    ("{cluster: 1}", ValueError, "TF_CONFIG is not valid JSON (Expecting property name "
                                 "enclosed in double quotes at line 1 column 2)"),
    ("[1, 2]", TypeError, "TF_CONFIG must be a JSON object with 'cluster' and 'task', "
                          "got list [1, 2]"),
    (json.dumps({"task": {"type": "worker", "index": 0}}), ValueError,
     "TF_CONFIG has no 'cluster' (keys: ['task'])"),
    (json.dumps({"cluster": TWO}), ValueError,
     "TF_CONFIG has no 'task': say which of the cluster's tasks this process is"),
    (config(task={"type": "worker"}), ValueError,
     "TF_CONFIG task {'type': 'worker'} has no 'index'"),
    (config(task={"index": 0}), ValueError, "TF_CONFIG task {'index': 0} has no 'type'"),
    (config(task={"type": "worker", "index": 2}), ValueError,
     "TF_CONFIG task index 2 is out of range: the cluster has 2 worker tasks (indices 0..1)"),
    (config(task={"type": "worker", "index": -1}), ValueError,
     "TF_CONFIG task index -1 is out of range"),
    (config(task={"type": "worker", "index": "1"}), TypeError,
     "TF_CONFIG task index must be an int, got str '1'"),
    (config(task={"type": "chief", "index": 0}), ValueError,
     "TF_CONFIG task type 'chief' is not a job of the cluster, which has ['worker']"),
    (config({"worker": ["127.0.0.1"]}), ValueError,
     "TF_CONFIG cluster['worker'][0] '127.0.0.1' has no port: give 'host:port'"),
    (config({"worker": ["127.0.0.1:http"]}), ValueError,
     "TF_CONFIG cluster['worker'][0] '127.0.0.1:http': port 'http' is not a number in "
     "1..65535"),
    (config({"worker": ["127.0.0.1:70000"]}), ValueError, "port '70000' is not a number"),
    (config({"worker": ["127.0.0.1:0"]}), ValueError, "port '0' is not a number"),
    (config({"worker": [":2222"]}), ValueError,
     "TF_CONFIG cluster['worker'][0] ':2222' has no valid host name or IP before the port"),
    (config({"worker": ["my host:2222"]}), ValueError, "has no valid host name or IP"),
    (config({"worker": ["grpc://10.0.0.1:2222"]}), ValueError,
     "TF_CONFIG cluster['worker'][0] 'grpc://10.0.0.1:2222' has a scheme"),
    (config({"worker": ["[zz]:2222"]}), ValueError, "has no valid host name or IP"),
    (config({"worker": [2222]}), TypeError,
     "TF_CONFIG cluster['worker'][0] must be a 'host:port' string, got int 2222"),
    (config({"worker": "h:1"}), TypeError,
     "TF_CONFIG cluster['worker'] must be a list of 'host:port' addresses, got str"),
    (config({"worker": []}), ValueError, "TF_CONFIG cluster['worker'] is empty"),
    (config({"worker": ["a:1", "A:1"]}), ValueError,
     "TF_CONFIG cluster['worker'][1] 'A:1' is the address of worker 0 too"),
    (config({"worker": ["a:1"], "ps": ["b:1"]}), ValueError,
     "TF_CONFIG cluster has jobs ['ps']; tfreduce's synchronous all-reduce runs among "
     "'worker' tasks"),
    (config({"chief": ["a:1", "b:1"]}), ValueError,
     "TF_CONFIG cluster['chief'] lists 2 addresses ['a:1', 'b:1']; a cluster has at most "
     "one chief"),
    (config({}), ValueError, "TF_CONFIG cluster lists no 'worker' (or 'chief') tasks"),
    (config(["a:1"]), TypeError, "TF_CONFIG 'cluster' must map job names to lists"),
    (config(rpc_layer="grpc+verbs"), ValueError,
     "TF_CONFIG rpc_layer 'grpc+verbs' is not supported"),
]


@pytest.mark.parametrize("text,error,message", BAD_CONFIGS,
                         ids=[m[:40] for _, _, m in BAD_CONFIGS])
def test_bad_tf_config(monkeypatch, text, error, message):
    monkeypatch.setenv("TF_CONFIG", text)
    with pytest.raises(error, match=re.escape(message)):
        Cluster.from_tf_config()


@pytest.mark.parametrize("timeout", [0, -1, "60", True])
def test_bad_timeout(timeout):
    with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
        Cluster(TWO, "worker", 0, timeout=timeout)


def test_default_timeout():
    assert Cluster(TWO, "worker", 0).timeout == DEFAULT_TIMEOUT


# ------------------------------------------------------------------ topology

def test_devices_get_this_workers_job_and_task():
    cluster = Cluster(TWO, "worker", 1)
    assert cluster.devices(["/gpu:1", "CPU:0", "/job:localhost/replica:0/task:0/device:CPU:2",
                            "/job:worker/task:1/device:GPU:3"]) == [
        "/job:worker/replica:0/task:1/device:GPU:1",
        "/job:worker/replica:0/task:1/device:CPU:0",
        "/job:worker/replica:0/task:1/device:CPU:2",
        "/job:worker/replica:0/task:1/device:GPU:3"]


def test_device_of_another_worker_is_an_error():
    cluster = Cluster(TWO, "worker", 1)
    with pytest.raises(ValueError, match=re.escape(
            "devices[1] '/job:worker/task:0/device:GPU:0' is not a device of this process, "
            "which is /job:worker/replica:0/task:1 (worker 1 (127.0.0.1:2223))")):
        cluster.devices(["/gpu:0", "/job:worker/task:0/device:GPU:0"])
    with pytest.raises(ValueError, match="does not name one device"):
        cluster.device("/job:worker")


@pytest.mark.parametrize("batch,towers,expected", [
    (10, 2, [(0, 6), (6, 10)]),      # shards 3, 3, 2, 2
    (8, 2, [(0, 4), (4, 8)]),
    (7, 1, [(0, 4), (4, 7)]),
    (4, 2, [(0, 2), (2, 4)]),
])
def test_batch_slice_follows_the_global_tower_split(batch, towers, expected):
    got = [Cluster(TWO, "worker", r).batch_slice(batch, towers) for r in range(2)]
    assert got == expected


def test_batch_slice_errors():
    cluster = Cluster(TWO, "worker", 0)
    with pytest.raises(ValueError, match=re.escape(
            "global batch size 3 is smaller than the 4 towers (2 workers x 2)")):
        cluster.batch_slice(3, 2)
    with pytest.raises(ValueError, match="towers_per_worker must be an int >= 1, got 0"):
        cluster.batch_slice(8, 0)


def test_every_worker_derives_the_same_keys():
    ranks = [Cluster(TWO, "worker", r) for r in range(2)]
    assert ranks[0].group_key(["/device:CPU:0"]) == ranks[1].group_key(["/device:CPU:0"])
    assert ranks[0].group_key(["/device:CPU:0"]) != ranks[0].group_key(["/device:CPU:1"])
    assert [c.keys.instance_key() for c in ranks] == [2 ** 30 + 1] * 2


def test_session_config_keeps_the_given_settings():
    base = tf.compat.v1.ConfigProto(device_count={"CPU": 3})
    got = Cluster(TWO, "worker", 1).session_config(base)
    assert got.device_count["CPU"] == 3
    assert got.experimental.collective_group_leader == "/job:worker/replica:0/task:0"
    assert list(got.device_filters) == ["/job:worker/replica:0/task:1"]
    assert not base.device_filters  # the argument is not changed


# ------------------------------------------------------------------ servers

def test_taken_port_is_reported_before_starting():
    holder = listening_socket()
    try:
        port = holder.getsockname()[1]
        cluster = Cluster({"worker": [f"127.0.0.1:{port}"]}, "worker", 0)
        with pytest.raises(ValueError, match=re.escape(
                f"worker 0 (127.0.0.1:{port}): port {port} cannot be opened on this host")):
            cluster.start_server()
        with pytest.raises(ValueError, match="cannot be opened"):
            cluster.start()
    finally:
        holder.close()


def test_finish_needs_a_started_cluster():
    with pytest.raises(RuntimeError, match=re.escape(
            "finish(): start the cluster first (start() or start_server())")):
        Cluster(TWO, "worker", 0).finish()


# ------------------------------------------------------------------ failures

def two_workers(peer_port):
    return Cluster({"worker": ["127.0.0.1:2222", f"127.0.0.1:{peer_port}"]}, "worker", 0,
                   timeout=12)


def test_lost_worker_is_named():
    cluster = two_workers(closed_port())
    error = tf.errors.UnavailableError(
        None, None, "Graph execution error:\n\nCollective ops is aborted by: Socket closed")
    with pytest.raises(WorkerLostError) as info:
        with cluster.detect_lost_workers(probe_timeout=1.0):
            raise error
    assert info.value.lost == [f"worker 1 ({cluster.address(1)})"]
    assert info.value.error is error
    assert str(info.value).startswith(
        f"worker 0 (127.0.0.1:2222): lost worker 1 ({cluster.address(1)}): it does not "
        f"answer, and the all-reduce cannot go on without it. Stop every worker, restart "
        f"them all and resume from the last checkpoint.")
    assert str(info.value).endswith(
        "(TF: UnavailableError: Collective ops is aborted by: Socket closed)")


def test_lost_worker_error_names_the_collective_it_waited_in():
    cluster = two_workers(closed_port())
    error = tf.errors.UnavailableError(
        None, None, "Graph execution error:\n\nDetected at node "
        "allreduce_multiworker/entry0_cross_worker defined at (most recent call last):\n"
        "  File step.py, line 3\n\nCollective ops is aborted by: worker 1 froze\n\t "
        "[[{{node allreduce_multiworker/entry0_cross_worker}}]] [Op:__inference_train_9]")
    with pytest.raises(WorkerLostError, match=re.escape(
            f"lost worker 1 ({cluster.address(1)}): it does not answer, and the collective "
            f"this worker waits in (allreduce_multiworker/entry0_cross_worker) cannot go on "
            f"without it.")) as info:
        with cluster.detect_lost_workers(probe_timeout=1.0):
            raise error
    assert str(info.value).endswith(
        "(TF: UnavailableError: Collective ops is aborted by: worker 1 froze)")


def test_timeout_with_every_worker_answering():
    peer = listening_socket()
    try:
        cluster = two_workers(peer.getsockname()[1])
        with pytest.raises(WorkerLostError, match=re.escape(
                "worker 0 (127.0.0.1:2222): a collective waited 12s for its peers and "
                "every worker still answers: one of them is stuck")) as info:
            with cluster.detect_lost_workers(probe_timeout=1.0):
                raise tf.errors.DeadlineExceededError(None, None, "timed out")
        assert info.value.lost == []
        # Unavailable while everyone answers is not about a lost worker.
        with pytest.raises(tf.errors.UnavailableError):
            with cluster.detect_lost_workers(probe_timeout=1.0):
                raise tf.errors.UnavailableError(None, None, "something else")
    finally:
        peer.close()


def test_other_errors_pass_through():
    cluster = two_workers(closed_port())
    with pytest.raises(tf.errors.InvalidArgumentError):
        with cluster.detect_lost_workers():
            raise tf.errors.InvalidArgumentError(None, None, "bad shape")
    with pytest.raises(KeyError):
        with cluster.detect_lost_workers():
            raise KeyError("x")


def test_a_peer_never_heard_at_start_is_named():
    # What Cluster.start() raises when a peer's watchdog was not heard within
    # the timeout (the wait itself: test_watchdog.py).
    cluster = Cluster(TWO, "worker", 0, timeout=42)
    error = unheard_workers(cluster, [1])
    assert isinstance(error, WorkerLostError) and error.lost == ["worker 1 (127.0.0.1:2223)"]
    assert str(error) == (
        "worker 0 (127.0.0.1:2222): no heartbeat from worker 1 (127.0.0.1:2223) within 42 s of "
        "this worker's start: not started, or UDP between the hosts is blocked (the watchdog's "
        "heartbeats go to the port number of each worker's server; stall_seconds=0 runs "
        "without it)")
