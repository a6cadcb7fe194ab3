"""tfreduce.Reduction: the one value that owns "how to communicate", and every door built on it."""

import copy
import dataclasses
import inspect
import os
import pickle
import pydoc
import re
import signal
import subprocess
import sys
import textwrap
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfreduce
from helpers import CPU_DEVICES, GPU_DEVICES, check, place, placeholders, run_in_function
from test_planner import spy_on_plans
from tfreduce.workers.cluster import Cluster
from tfreduce.workers.localcluster import LocalCluster
from tfreduce.doors.multiworker import allreduce_grads_multiworker, broadcast_variables_multiworker
from tfreduce.trainer import ReplicatedTrainer

OPTIONS = ["algorithm", "groups", "communication", "keys", "timeout", "pack_bytes",
           "sparse_as_dense", "compression", "topology", "deterministic"]
SPEC = {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}


def mlp():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"),
                             keras.layers.Dense(3)])


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def sgd():
    return keras.optimizers.SGD(0.1)


def data(n=32):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 5)).astype(np.float32), rng.integers(0, 3, size=n)


# ------------------------------------------------------------------ the value

def test_every_option_is_in_the_signature_and_help_points_to_it():
    assert list(inspect.signature(tfreduce.Reduction).parameters) == OPTIONS
    # Only the algorithm is positional.
    kinds = [p.kind for p in inspect.signature(tfreduce.Reduction).parameters.values()]
    assert kinds == [inspect.Parameter.POSITIONAL_OR_KEYWORD] + [
        inspect.Parameter.KEYWORD_ONLY] * (len(OPTIONS) - 1)
    doc = pydoc.render_doc(tfreduce.Reduction, renderer=pydoc.plaintext)
    for name in OPTIONS:
        assert re.search(rf"^[ |]+{name}: ", doc, re.MULTILINE), name
    for door in (tfreduce.allreduce_grads, tfreduce.ReplicatedTrainer, tfreduce.CrossDeviceOps):
        assert "tfreduce.Reduction" in pydoc.render_doc(door, renderer=pydoc.plaintext)


def test_a_frozen_value_compared_by_its_choice():
    a = tfreduce.Reduction("hierarchical", groups=[[0, 1], [2, 3]], compression="fp16")
    b = tfreduce.Reduction("hierarchical", groups=((0, 1), (2, 3)),
                           compression=tfreduce.Compression.fp16)
    assert a == b and hash(a) == hash(b)
    assert a != tfreduce.Reduction("hierarchical", groups=[[0, 2], [1, 3]], compression="fp16")
    assert a.groups == ((0, 1), (2, 3)) and a.compression is tfreduce.Compression.fp16
    assert tfreduce.Reduction().compression is tfreduce.Compression.none
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.algorithm = "ring"
    assert repr(a) == ("tfreduce.Reduction('hierarchical', groups=[[0, 1], [2, 3]], "
                       "compression='fp16')")
    keys = tfreduce.CollectiveKeys()
    assert tfreduce.Reduction("collective", keys=keys, timeout=5).describe() == (
        "'collective', keys=CollectiveKeys, timeout=5")
    assert tfreduce.Reduction(topology="dgx-a100", pack_bytes=None).describe() == (
        "'auto', pack_bytes=None, topology='dgx-a100'")


COPIES = {"copy": copy.copy, "deepcopy": copy.deepcopy,
          "pickle": lambda value: pickle.loads(pickle.dumps(value))}


@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_copied_or_pickled_reduction_equals_the_original_and_hashes_alike(how):
    # Once, Compressor compared by identity: a deep copy or an unpickled
    # Reduction("ring", compression="fp16") was no longer equal to it.
    used = tfreduce.Reduction(topology=tfreduce.Topology.fully_connected(4, 1e9, 0.0))
    with tf.Graph().as_default():  # planned once: the planner keeps the plan
        used(placeholders(CPU_DEVICES[:4], [(64,)]), CPU_DEVICES[:4])
    keys = tfreduce.CollectiveKeys()
    values = [tfreduce.Reduction("ring", compression="fp16"), tfreduce.Compression.bf16,
              tfreduce.Reduction("hierarchical", groups=[[0, 1], [2, 3]], pack_bytes=None),
              tfreduce.Reduction(topology="dgx1-v100"), tfreduce.Topology.preset("dgx-a100"),
              used]
    if how != "pickle":
        values.append(tfreduce.Reduction("collective", keys=keys, timeout=5))
    for value in values:
        again = COPIES[how](value)
        assert again == value and hash(again) == hash(value), value
        assert {value: 1}[again] == 1
    assert COPIES[how](tfreduce.Reduction("ring", compression="fp16")) != tfreduce.Reduction(
        "ring", compression="bf16")
    assert COPIES[how](tfreduce.Topology.preset("dgx-a100")) != tfreduce.Topology.preset(
        "dgx1-v100")


def test_collective_keys_are_shared_by_copies_and_new_once_pickled():
    # One counter per program: a copy handing out the same instance keys
    # again would pair two reductions' ops. Another process has its own.
    keys = tfreduce.CollectiveKeys()
    reduction = tfreduce.Reduction("collective", keys=keys)
    assert copy.deepcopy(reduction).keys is keys and copy.copy(keys) is keys
    keys.instance_key()
    again = pickle.loads(pickle.dumps(keys))
    assert again is not keys and again.instance_key() == keys.instance_key() == 2


@pytest.mark.parametrize("kwargs, error, message", [
    ({"algorithm": "butterfly"}, ValueError,
     "unknown all-reduce algorithm 'butterfly'; choose one of ('auto', 'flat', 'hierarchical', "
     "'ring', 'nccl', 'collective')"),
    ({"algorithm": "flat", "groups": [[0], [1]]}, TypeError,
     "algorithm 'flat' takes no option ['groups']; it takes ['compression', 'deterministic', "
     "'pack_bytes', 'sparse_as_dense']"),
    ({"algorithm": "ring", "timeout": 3}, TypeError,
     "algorithm 'ring' takes no option ['timeout']"),
    ({"groups": [[0, 1]]}, TypeError,
     "algorithm 'auto' takes no option ['groups']; it takes ['compression', 'deterministic', "
     "'pack_bytes', 'sparse_as_dense']: 'auto' picks the algorithm from the devices; name the algorithm to "
     "give its own options"),
    ({"algorithm": "ring", "topology": "dgx-a100"}, ValueError,
     "topology= chooses the algorithm (algorithm='auto'), but algorithm='ring' was named"),
    ({"topology": "dgx-a100", "communication": "ring"}, TypeError,
     "planning takes only the frame's options ['pack_bytes', 'sparse_as_dense', "
     "'compression'], got ['communication']"),
    ({"topology": "dgx-z"}, ValueError, "unknown topology preset 'dgx-z'"),
    ({"topology": 3}, TypeError, 'topology must be a tfreduce.Topology, a preset name or "host"'),
    ({"pack_bytes": -1}, ValueError, "pack_bytes must be >= 0 bytes, got -1"),
    ({"pack_bytes": "big"}, TypeError, "pack_bytes must be an int number of bytes or None, "
                                       "got 'big'"),
    ({"sparse_as_dense": 1}, TypeError, "sparse_as_dense must be True or False"),
    ({"compression": "fp8"}, ValueError, "compression must be None, 'fp16' or 'bf16', got 'fp8'"),
    ({"algorithm": "hierarchical", "groups": [[0, 1], [1]]}, ValueError,
     "device index 1 is in groups[0] and groups[1]"),
    ({"algorithm": "hierarchical", "groups": [[0, 2]]}, ValueError,
     "groups [[0, 2]] leave device indices [1] out"),
    ({"algorithm": "hierarchical", "groups": [[0], "1"]}, TypeError,
     "groups[1] must be a list of device indices, got '1'"),
    ({"algorithm": "collective", "communication": "pigeon"}, ValueError,
     "communication must be one of ('auto', 'ring', 'nccl'), got 'pigeon'"),
    ({"algorithm": "collective", "timeout": 0}, ValueError,
     "timeout must be a number of seconds > 0 or None (wait forever), got 0"),
    ({"algorithm": "collective", "keys": 7}, TypeError,
     "keys must be a tfreduce.CollectiveKeys or None, got int 7"),
])
def test_every_choice_is_checked_when_made(kwargs, error, message):
    with pytest.raises(error) as info:
        tfreduce.Reduction(**kwargs)
    assert message in str(info.value)


# ------------------------------------------------------------------ the one check

@pytest.fixture
def count_checks(monkeypatch):
    """Counts the checks of the communication choice (each runs Reduction.__post_init__)."""
    calls = []
    check = tfreduce.Reduction.__post_init__

    def counting(self):
        calls.append(self.algorithm)
        check(self)

    monkeypatch.setattr(tfreduce.Reduction, "__post_init__", counting)
    return calls


def test_allreduce_grads_checks_its_choice_once(count_checks):
    with tf.Graph().as_default():
        grads = placeholders(GPU_DEVICES[:4], [(3,), (2, 2)])
        tfreduce.allreduce_grads(grads, GPU_DEVICES[:4], algorithm="hierarchical",
                                 groups=[[0, 1], [2, 3]], pack_bytes=None)
        tfreduce.allreduce_grads_ring(grads, GPU_DEVICES[:4], compression="bf16")
    assert count_checks == ["hierarchical", "ring"]


def test_the_trainer_checks_its_choice_once(count_checks):
    trainer = ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2], algorithm="ring",
                                pack_bytes=None)
    x, y = data()
    trainer.train_step(x, y)
    trainer.train_step(x, y)
    assert count_checks == ["ring"]


def test_cross_device_ops_checks_its_choice_once(count_checks):
    strategy = tf.distribute.MirroredStrategy(
        CPU_DEVICES[:2], cross_device_ops=tfreduce.CrossDeviceOps("ring", pack_bytes=None))
    value = strategy.run(lambda: tf.ones([3]) * tf.cast(
        tf.distribute.get_replica_context().replica_id_in_sync_group + 1, tf.float32))
    for _ in range(2):
        out = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, [(value, value)])
    assert [v.numpy().tolist() for v in out[0].values] == [[3.0] * 3, [3.0] * 3]
    assert count_checks == ["ring"]


def test_the_multi_worker_path_checks_its_choice_once(count_checks):
    with tf.Graph().as_default():
        grads = placeholders(GPU_DEVICES[:2], [(3,), (5,)])
        allreduce_grads_multiworker(grads, GPU_DEVICES[:2], cluster=Cluster(SPEC, "worker", 1),
                                    local_algorithm="hierarchical",
                                    local_options={"groups": [[0], [1]]}, compression="fp16")
    assert count_checks == ["hierarchical"]


# ------------------------------------------------------------------ calling it

@pytest.mark.parametrize("algorithm", ["flat", "hierarchical", "ring", "collective"])
def test_calling_the_value_equals_numpy_on_every_device(algorithm):
    devices = CPU_DEVICES[:3]
    rng = np.random.default_rng(1)
    arrays = [[rng.integers(-9, 9, size=(4, 3)).astype(np.float32),
               rng.integers(-9, 9, size=(5,)).astype(np.float64)] for _ in devices]
    reduction = tfreduce.Reduction(algorithm, pack_bytes=None)
    for average in (False, True):
        values, placed = run_in_function(
            lambda grads: reduction(grads, devices, average=average), arrays, devices)
        check(values, placed, arrays, average, [d[len("/device"):] for d in devices])


def test_every_door_takes_a_reduction():
    reduction = tfreduce.Reduction("hierarchical", groups=[[0], [1]], pack_bytes=None)
    devices = CPU_DEVICES[:2]
    arrays = [[np.full((3,), k + 1.0, np.float32)] for k in range(2)]
    out = tfreduce.allreduce_grads(place(arrays, devices), devices, reduction=reduction)
    assert [t.numpy().tolist() for t in (out[0][0], out[1][0])] == [[3.0] * 3] * 2
    assert out[1][0].device.endswith("CPU:1")
    trainer = ReplicatedTrainer(mlp, LOSS, sgd, devices=devices, reduction=reduction)
    assert trainer.reduction is reduction
    assert tfreduce.CrossDeviceOps(reduction=reduction).reduction is reduction
    with pytest.raises(TypeError, match=re.escape(
            "pass either reduction= or the algorithm and its options, not both: got "
            "tfreduce.Reduction('hierarchical', groups=[[0], [1]], pack_bytes=None) and "
            "algorithm='ring', options []")):
        tfreduce.allreduce_grads(place(arrays, devices), devices, algorithm="ring",
                                 reduction=reduction)
    with pytest.raises(TypeError, match=r"^CrossDeviceOps: pass either reduction= or the "
                                        r"algorithm and its options, not both: .* options "
                                        r"\['pack_bytes'\]$"):
        tfreduce.CrossDeviceOps(reduction=reduction, pack_bytes=None)
    with pytest.raises(TypeError, match="reduction must be a tfreduce.Reduction, got str 'ring'"):
        ReplicatedTrainer(mlp, LOSS, sgd, devices=devices, reduction="ring")


def test_the_trainer_checks_the_devices_when_made():
    with pytest.raises(ValueError, match=r"groups \[\[0, 1, 2\]\] leave device indices \[3\]"):
        ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:4],
                          reduction=tfreduce.Reduction("hierarchical", groups=[[0, 1, 2]]))
    with pytest.raises(ValueError, match="NCCL runs only on GPUs"):
        ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2], algorithm="nccl")


@pytest.mark.slow
def test_a_topology_plans_once_per_layout_and_the_plan_holds_a_reduction(monkeypatch):
    plans = spy_on_plans(monkeypatch)
    bandwidth_bound = tfreduce.Topology.fully_connected(4, 1e9, 0.0)
    reduction = tfreduce.Reduction(topology=bandwidth_bound, compression="bf16")
    devices = CPU_DEVICES[:4]
    for shape in ((2**16,), (2**16,), (2**14,)):
        with tf.Graph().as_default():
            reduction(placeholders(devices, [shape]), devices)
    assert len(plans) == 2  # the second call with the first shape reuses its plan
    with tf.Graph().as_default():  # a Reduction is a value: an equal one has the same plans
        tfreduce.Reduction(topology=bandwidth_bound, compression="bf16")(
            placeholders(devices, [(2**16,)]), devices)
    assert len(plans) == 2
    plan = plans[0]
    chosen = plan.reduction
    assert isinstance(chosen, tfreduce.Reduction) and chosen.topology is None
    assert chosen.algorithm == plan.algorithm == "ring"
    assert chosen.pack_bytes == plan.options["pack_bytes"]
    assert chosen.compression is tfreduce.Compression.bf16  # kept from the planned reduction
    same = tfreduce.plan_allreduce([[2**16]], devices, bandwidth_bound, average=False,
                                   compression="bf16")
    assert same.reduction == chosen and same.kwargs() == plan.kwargs()
    with pytest.raises(ValueError, match="plan: this Reduction has no topology to plan for"):
        tfreduce.Reduction("ring").plan([[4]], devices)


def test_a_topology_is_for_one_process():
    reduction = tfreduce.Reduction(topology="dgx-a100")
    with pytest.raises(ValueError) as info:
        reduction.check_devices(GPU_DEVICES[:2], Cluster(SPEC, "worker", 0))
    assert str(info.value) == (
        "topology='dgx-a100': a plan is for the devices of one process; across workers pass "
        "its choice, tfreduce.plan_allreduce(...).reduction")
    reduction.check_devices(GPU_DEVICES[:2], LocalCluster())  # one process: fine
    with pytest.raises(ValueError, match="has 8 devices, fewer than the 16 given"):
        reduction.check_devices([f"/gpu:{k}" for k in range(16)])


# ------------------------------------------------------------------ compression, PowerSGD

def test_one_compression_type_everywhere():
    fp16 = tfreduce.Compression.fp16
    with tf.Graph().as_default() as graph:
        grads = placeholders(GPU_DEVICES[:2], [(8,)])
        allreduce_grads_multiworker(grads, GPU_DEVICES[:2], cluster=Cluster(SPEC, "worker", 0),
                                    local_algorithm="flat", compression=fp16)
        [cross] = [op for op in graph.get_operations() if op.name.endswith("_cross_worker")]
        assert cross.inputs[0].dtype == tf.float16
        out = tfreduce.allreduce_grads(grads, GPU_DEVICES[:2], algorithm="ring", compression=fp16)
        assert tfreduce.analyze_traffic(out, inputs=grads).total_bytes == 2 * 2 * 4 * 2
    assert tfreduce.CrossDeviceOps("flat", compression=fp16).reduction.compression is fp16
    trainer = ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2], compression=fp16)
    assert trainer.reduction.compression is fp16


@pytest.mark.slow
def test_powersgd_is_an_option_of_its_own_and_the_old_spelling_warns():
    x, y = data(48)
    weights = {}
    for how in ("powersgd", "compression"):
        kwargs = {how: tfreduce.PowerSGD(rank=1, min_compression_rate=0)}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2], **kwargs)
        deprecated = [w for w in caught if issubclass(w.category, DeprecationWarning)]
        assert len(deprecated) == (how == "compression")
        if deprecated:
            assert str(deprecated[0].message) == (
                "ReplicatedTrainer(compression=tfreduce.PowerSGD(...)) is deprecated: pass "
                "powersgd=tfreduce.PowerSGD(...)")
        for step in range(3):
            trainer.train_step(x[step * 16:(step + 1) * 16], y[step * 16:(step + 1) * 16])
        assert trainer.reduction.compression is tfreduce.Compression.none
        weights[how] = trainer.models[1].get_weights()
    for a, b in zip(weights["powersgd"], weights["compression"]):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match=r"^powersgd=tfreduce.PowerSGD needs an instance: "
                                        r"PowerSGD\(rank=2\)$"):
        ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2], powersgd=tfreduce.PowerSGD)
    with pytest.raises(TypeError, match="powersgd must be a tfreduce.PowerSGD or None, got str"):
        ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2], powersgd="rank2")


def test_powersgd_with_16_bit_wire_compression():
    # Both at once: the P's and Q's of PowerSGD cross devices in bfloat16.
    x, y = data(32)
    trainer = ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2], algorithm="flat",
                                compression="bf16",
                                powersgd=tfreduce.PowerSGD(rank=1, min_compression_rate=0))
    losses = [trainer.train_step(x, y) for _ in range(4)]
    assert trainer.check_replicas() == 0.0 and losses[-1] < losses[0]
    graph = trainer.step_graphs()["train"]
    casts = [op for op in graph.get_operations()
             if op.type == "Cast" and op.outputs[0].dtype == tf.bfloat16]
    assert casts


# ------------------------------------------------------------------ one process as a cluster

def test_one_process_is_a_local_cluster():
    trainer = ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2], cluster=None)
    assert trainer.cluster is None and trainer.is_chief
    local = LocalCluster()
    assert (local.is_local, local.num_workers, local.rank, local.is_chief) == (True, 1, 0, True)
    assert local.batch_slice(10, 4) == (0, 10) and local.start() is local
    assert local.devices(["/cpu:1", "CPU:0"]) == ["/device:CPU:1", "/device:CPU:0"]
    with local.detect_lost_workers():
        pass
    assert local.finish() is None
    # The multi-worker broadcast over one process is the local broadcast.
    variables = []
    for k, device in enumerate(CPU_DEVICES[:3]):
        with tf.device(device):
            variables.append([tf.Variable([float(k)] * 2), tf.Variable(float(k) + 10)])
    assert broadcast_variables_multiworker(variables, local) is None
    assert [[v.numpy().tolist() for v in row] for row in variables] == [[[0.0, 0.0], 10.0]] * 3
    assert all(row[0].device.endswith(f"CPU:{k}") for k, row in enumerate(variables))


def test_tracing_counts_is_public():
    unbuilt = ReplicatedTrainer(lambda: keras.Sequential([keras.layers.Dense(3)]), LOSS, sgd,
                                devices=CPU_DEVICES[:2])
    with pytest.raises(ValueError, match="tracing_counts: the models are not built yet"):
        unbuilt.tracing_counts()
    trainer = ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2])
    assert trainer.tracing_counts() == {"train": 0, "evaluate": 0, "predict": 0}
    x, y = data()
    trainer.train_step(x, y)
    trainer.train_step(x[:9], y[:9])  # another batch size: no retrace
    assert trainer.tracing_counts() == {"train": 1, "evaluate": 0, "predict": 0}


def test_sparse_as_dense_across_workers_reduces_densely_through_the_cross_worker_hop():
    devices = GPU_DEVICES[:2]
    with tf.Graph().as_default() as graph:
        grads = []
        for k, device in enumerate(devices):
            with tf.device(device):
                grads.append([tf.IndexedSlices(tf.ones([2, 3]), tf.constant([k, 3]),
                                               tf.constant([5, 3]))])
        out = tfreduce.Reduction("flat", sparse_as_dense=True)(
            grads, devices, average=True, cluster=Cluster(SPEC, "worker", 1))
        types = [op.type for op in graph.get_operations()]
        [cross] = [op for op in graph.get_operations() if op.name.endswith("_cross_worker")]
    assert cross.type == "CollectiveReduceV2" and cross.inputs[0].shape == [5, 3]
    assert "CollectiveGatherV2" not in types
    assert all(isinstance(row[0], tf.Tensor) and row[0].shape == [5, 3] for row in out)
    assert out[1][0].device == "/job:worker/replica:0/task:1/device:GPU:1"


def test_a_stop_asked_for_during_a_step_ends_fit_after_that_step():
    # SIGTERM while fit's second step (the trainer's third) runs: one
    # process stops after that step, not the next.
    trainer = ReplicatedTrainer(mlp, LOSS, sgd, devices=CPU_DEVICES[:2])
    x, y = data(64)
    trainer.train_step(x[:8], y[:8])  # builds the step functions

    def signalled(step, phase):
        if step == 3 and phase == "end":  # step 3 ran; fit has not decided yet
            os.kill(os.getpid(), signal.SIGTERM)

    trainer.fault_hook = signalled
    with pytest.raises(KeyboardInterrupt) as info:
        trainer.fit(x, y, epochs=1, batch_size=8, verbose=0)
    assert trainer.step == 3
    assert "SIGTERM" in str(info.value)


def test_the_multi_worker_reduction_takes_a_reduction():
    cluster = Cluster(SPEC, "worker", 0)
    reduction = tfreduce.Reduction("hierarchical", groups=[[0], [1]], compression="fp16")
    with tf.Graph().as_default() as graph:
        grads = placeholders(GPU_DEVICES[:2], [(8,), (3, 2)])
        allreduce_grads_multiworker(grads, GPU_DEVICES[:2], cluster=cluster, reduction=reduction)
        # Both gradients in one 4 MiB pack, crossing workers in float16.
        [cross] = [op for op in graph.get_operations() if op.name.endswith("_cross_worker")]
        assert cross.inputs[0].dtype == tf.float16 and cross.inputs[0].shape == [14]
        assert [op for op in graph.get_operations() if "allreduce_hierarchical" in op.name]
        with pytest.raises(TypeError, match=r"pass either reduction= or the algorithm and its "
                                            r"options, not both: .* options \['compression'\]"):
            allreduce_grads_multiworker(grads, GPU_DEVICES[:2], cluster=cluster,
                                        reduction=reduction, compression="bf16")


@pytest.mark.slow
def test_the_doors_load_the_cost_model_only_to_plan():
    # The planner imports the cost model and the host probe: a reduction
    # that is not planned (no topology=) loads neither.
    code = textwrap.dedent("""
        import sys
        import tensorflow as tf
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0],
            [tf.config.LogicalDeviceConfiguration()] * 2)
        import tfreduce
        devices = ["/cpu:0", "/cpu:1"]
        grads = [[tf.constant([1.0, 2.0])], [tf.constant([3.0, 4.0])]]
        tfreduce.allreduce_grads(grads, devices, algorithm="ring")
        tfreduce.reduce_scatter(grads, devices)
        planned = tfreduce.Reduction(topology="dgx-a100")  # checked, not yet planned
        loaded = lambda: sorted(m for m in ("tfreduce.analysis.costmodel",
                                            "tfreduce.analysis.planner",
                                            "tfreduce.analysis.hostprobe") if m in sys.modules)
        print(loaded())
        planned.plan([[4]], ["/gpu:0", "/gpu:1"])
        print(loaded())
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-2:] == [
        "[]", "['tfreduce.analysis.costmodel', 'tfreduce.analysis.hostprobe', "
              "'tfreduce.analysis.planner']"]
