"""tfreduce.tensorflow(.keras) in one process: Horovod's names and signatures, size-1 semantics, errors.

The 2-process runs are in tests/test_horovod.py.
"""

import inspect
import json
import os
import socket
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfreduce
import tfreduce.tensorflow as hvd
import tfreduce.tensorflow.keras as hvdk
import zygote
from tfreduce.basis.contract import shard_sizes
from tfreduce.basis.tf_config import expand_hostlist, expand_tasks_per_node, slurm_tf_config

# Horovod's signatures (horovod.tensorflow and horovod.tensorflow.keras,
# version 0.28), parameter names, order and defaults, as recorded from its source.
HOROVOD = {
    "init": "(comm=None, process_sets=None)",
    "shutdown": "()", "is_initialized": "()", "rank": "()", "size": "()",
    "local_rank": "()", "local_size": "()", "cross_rank": "()", "cross_size": "()",
    "allreduce": "(tensor, average=None, device_dense='', device_sparse='', "
                 "compression=Compression.none, op=None, prescale_factor=1.0, "
                 "postscale_factor=1.0, name=None, process_set=global_process_set, "
                 "ignore_name_scope=False)",
    "grouped_allreduce": "(tensors, average=None, device_dense='', device_sparse='', "
                         "compression=Compression.none, op=None, prescale_factor=1.0, "
                         "postscale_factor=1.0, process_set=global_process_set, "
                         "ignore_name_scope=False, name=None)",
    "allgather": "(tensor, name=None, ignore_name_scope=False, "
                 "process_set=global_process_set)",
    "grouped_allgather": "(tensors, name=None, ignore_name_scope=False, "
                         "process_set=global_process_set)",
    "broadcast": "(tensor, root_rank, name=None, ignore_name_scope=False, "
                 "process_set=global_process_set)",
    "broadcast_variables": "(variables, root_rank, process_set=global_process_set, "
                           "inplace=False)",
    "reducescatter": "(tensor, device_dense='', compression=Compression.none, op=Average, "
                     "name=None, process_set=global_process_set, ignore_name_scope=False, "
                     "prescale_factor=1.0, postscale_factor=1.0)",
    "grouped_reducescatter": "(tensors, device_dense='', compression=Compression.none, "
                             "op=Average, process_set=global_process_set, prescale_factor=1.0, "
                             "postscale_factor=1.0)",
    "alltoall": "(tensor, splits=None, name=None, ignore_name_scope=False, "
                "process_set=global_process_set)",
    "allgather_object": "(obj, session=None, name=None, process_set=global_process_set)",
    "broadcast_object": "(obj, root_rank=0, session=None, name=None, "
                        "process_set=global_process_set)",
    "broadcast_": "(variables, root_rank, name=None, process_set=global_process_set)",
    "broadcast_global_variables": "(root_rank)", "join": "()",
    "rank_op": "(name=None)", "local_rank_op": "(name=None)", "local_size_op": "(name=None)",
    "size_op": "(process_set_id=0, name=None)",
    "DistributedGradientTape": "(gradtape, device_dense='', device_sparse='', "
                               "compression=Compression.none, sparse_as_dense=False, "
                               "op=Average, gradient_predivide_factor=1.0, num_groups=0, "
                               "groups=None, process_set=global_process_set, "
                               "scale_local_gradients=True)",
}
HOROVOD_KERAS = {
    **{name: HOROVOD[name] for name in ("init", "shutdown", "is_initialized", "rank", "size",
                                        "local_rank", "local_size", "cross_rank",
                                        "cross_size")},
    "DistributedOptimizer": "(optimizer, name=None, device_dense='', device_sparse='', "
                            "compression=Compression.none, sparse_as_dense=False, "
                            "gradient_predivide_factor=1.0, op=Average, "
                            "backward_passes_per_step=1, average_aggregated_gradients=False, "
                            "num_groups=0, groups=None, process_set=global_process_set, "
                            "scale_local_gradients=True)",
    "allreduce": "(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, "
                 "op=None, compression=Compression.none)",
    "allgather": "(value, name=None)",
    "broadcast": "(value, root_rank, name=None)",
    "broadcast_global_variables": "(root_rank)",
    "callbacks.BroadcastGlobalVariablesCallback": "(root_rank, device='', local_variables=None)",
    "callbacks.MetricAverageCallback": "(device='')",
    "callbacks.LearningRateScheduleCallback": "(initial_lr, multiplier, start_epoch=0, "
                                              "end_epoch=None, staircase=True, "
                                              "momentum_correction=True, steps_per_epoch=None)",
    "callbacks.LearningRateWarmupCallback": "(initial_lr, warmup_epochs=5, "
                                            "momentum_correction=True, steps_per_epoch=None, "
                                            "verbose=0)",
}


# tfreduce's own settings: keyword-only, after Horovod's parameters, so that
# every call Horovod accepts means the same here.
OWN_KEYWORDS = {"init": ("stall_seconds", "timeout_seconds")}


def signature(module, name):
    obj = module
    for part in name.split("."):
        obj = getattr(obj, part)
    full = inspect.signature(obj)
    own = [p.name for p in full.parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert own == list(OWN_KEYWORDS.get(name, ())), (name, own)
    text = str(full.replace(parameters=[p for p in full.parameters.values()
                                        if p.kind is not p.KEYWORD_ONLY]))
    # Our defaults print as their values; Horovod's source names them.
    return (text.replace(f"compression={tfreduce.Compression.none!r}", "compression=Compression.none")
            .replace("op='average'", "op=Average"))


@pytest.mark.parametrize("module, table", [(hvd, HOROVOD), (hvdk, HOROVOD_KERAS)],
                         ids=["tensorflow", "keras"])
def test_every_horovod_name_has_horovods_signature(module, table):
    assert {name: signature(module, name) for name in table} == table
    assert hvd.Compression is tfreduce.Compression
    assert {hvd.Average, hvd.Sum} == {hvdk.Average, hvdk.Sum} and hvd.Average != hvd.Sum


@pytest.fixture
def one_process():
    hvd.init()
    yield
    hvd.shutdown()


def test_one_process_is_rank_0_of_1_and_reduces_to_itself(one_process):
    assert hvd.is_initialized()
    assert [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
            hvd.cross_size()] == [0, 1, 0, 1, 0, 1]
    x = tf.constant([1.5, -2.0])
    np.testing.assert_array_equal(hvd.allreduce(x), [1.5, -2.0])
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0), [3.0, -4.0])
    np.testing.assert_array_equal(hvd.allgather(tf.ones([2, 3])), np.ones([2, 3]))
    np.testing.assert_array_equal(hvd.broadcast(x, 0), [1.5, -2.0])
    np.testing.assert_array_equal(hvdk.allreduce([4.0, 2.0], op=hvdk.Sum), [4.0, 2.0])
    np.testing.assert_array_equal(hvd.reducescatter(tf.ones([3, 2]), op=hvd.Sum), np.ones([3, 2]))
    out, received = hvd.alltoall(tf.ones([2, 3]), splits=[2])
    np.testing.assert_array_equal(out, np.ones([2, 3]))
    assert received.numpy().tolist() == [2]
    np.testing.assert_array_equal(hvd.alltoall(tf.ones([2, 3])), np.ones([2, 3]))
    assert hvd.join().numpy() == 0 and hvd.join().dtype == tf.int32


def test_the_error_before_init():
    assert not hvd.is_initialized()
    for call in (hvd.rank, hvd.size, lambda: hvd.allreduce(tf.ones([2]))):
        with pytest.raises(RuntimeError, match=r"^tfreduce\.tensorflow\.init\(\) has not been "
                                               r"called: call it first, before building"):
            call()


def _in_v1_graph(call):
    with tf.Graph().as_default():
        return call()


@pytest.mark.parametrize("call, error, message", [
    (lambda: hvd.init(comm=[0, 1]), ValueError,
     "init(comm=[0, 1]): tfreduce takes no communicator; under mpirun the processes find "
     "each other over MPI by themselves (COMM_WORLD)"),
    (lambda: hvd.init(stall_seconds=-1), ValueError,
     "init(stall_seconds=-1, timeout_seconds=None): stall_seconds must be >= 0 (0: off), "
     "got -1"),
    (lambda: hvd.init(stall_seconds="5"), TypeError,
     "init: stall_seconds must be a number of seconds (0: off) or None, got str '5'"),
    (lambda: hvdk.callbacks.WorkerTimesCallback("logs", update_freq=0), ValueError,
     "WorkerTimesCallback: update_freq must be 'epoch', 'batch' or an int number of batches "
     "> 0, got 0"),
    (lambda: hvd.init(timeout_seconds=0), ValueError,
     "init(stall_seconds=None, timeout_seconds=0): timeout must be a number of seconds > 0 "
     "or None (300 s), got 0"),
    (lambda: hvd.allreduce(tf.ones([2]), op=hvd.Adasum), ValueError,
     "allreduce: op must be tfreduce.tensorflow.Average, Sum, Min, Max or Product, got "
     "'adasum' (Adasum is not supported)"),
    (lambda: hvd.allreduce(tf.ones([2]), op=hvd.Sum, average=True), ValueError,
     "allreduce: pass op= only"),
    (lambda: hvd.allgather(tf.constant(1.0)), ValueError,
     "allgather: tensor 0 is a scalar; gather tensors of rank >= 1"),
    (lambda: hvd.broadcast(tf.ones([2]), root_rank=1), ValueError,
     "broadcast: root_rank must be an int in 0..0 (the ranks of the 1 processes), got 1"),
    (lambda: hvd.allreduce(tf.ones([2]), process_set="evens"), ValueError,
     "allreduce: process_set='evens': only global_process_set"),
    (lambda: hvd.reducescatter(tf.constant(1.0)), ValueError,
     "reducescatter: tensor 0 is a scalar; its rows are scattered, so give tensors of rank >= 1 "
     "(tf.reshape(x, [1]))"),
    (lambda: hvd.alltoall(tf.ones([3]), splits=[1, 2]), ValueError,
     "alltoall: splits must be 1 ints (the rows sent to each process, in rank order), got "
     "[1, 2]"),
    (lambda: hvd.alltoall(tf.ones([3]), splits=[2]), ValueError,
     "alltoall: splits [2] add up to 2, but the tensor has 3 rows"),
    (lambda: hvd.DistributedGradientTape(object()), TypeError,
     "DistributedGradientTape needs a tf.GradientTape, got object"),
    (lambda: hvdk.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1)),
     TypeError, "DistributedOptimizer needs a Keras optimizer (keras.optimizers.Adam(...)), "
                "got tensorflow.python.training.gradient_descent.GradientDescentOptimizer"),
    (lambda: hvdk.DistributedOptimizer(keras.optimizers.SGD(), backward_passes_per_step=0),
     ValueError, "backward_passes_per_step must be an int >= 1, got 0"),
    (lambda: hvdk.DistributedOptimizer(keras.optimizers.SGD(), groups=2), ValueError,
     "DistributedOptimizer: num_groups=0, groups=2: explicit fusion groups are not supported"),
    (lambda: hvdk.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Sum,
                                       gradient_predivide_factor=2.0), ValueError,
     "DistributedOptimizer: gradient_predivide_factor=2.0 needs op=Average"),
    (lambda: hvdk.broadcast_global_variables(0), RuntimeError,
     "broadcast_global_variables(0): TensorFlow 2 has no global variables"),
    (lambda: hvd.broadcast_global_variables(0), RuntimeError,
     "broadcast_global_variables works in tf.compat.v1 graphs only: in TF2 call "
     "broadcast_variables(model.variables, root_rank)"),
    (lambda: hvd.allreduce(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0])), op=hvd.Max),
     NotImplementedError, "allreduce: op='max' does not reduce tf.IndexedSlices, only Sum and "
     "Average do"),
    (lambda: hvd.grouped_allreduce([tf.ones([2]), tf.IndexedSlices(tf.ones([1, 2]),
                                                                   tf.constant([0]))],
                                   op=hvd.Adasum),
     NotImplementedError, "grouped_allreduce: op=Adasum does not reduce tf.IndexedSlices"),
    (lambda: hvd.grouped_allreduce([tf.IndexedSlices([tf.ones([1, 3])], tf.constant([0]))],
                                   op=hvd.Min),  # values a list, as Horovod's tests give them
     NotImplementedError, "grouped_allreduce: op='min' does not reduce tf.IndexedSlices"),
    (lambda: tf.function(lambda: hvd.allgather_object(1), autograph=False)(), RuntimeError,
     "allgather_object runs eagerly or in a tf.compat.v1 session (a Python object crosses as "
     "its pickle): call it outside tf.function"),
    (lambda: _in_v1_graph(lambda: hvd.broadcast_object(1)), ValueError,
     "broadcast_object: in a tf.compat.v1 graph, pass session= or call it under a default "
     "session (with session.as_default())"),
    (lambda: tf.function(hvd.join, autograph=False)(), RuntimeError,
     "join() runs eagerly (or in a tf.compat.v1 session): inside a tf.function the "
     "collectives are traced"),
], ids=["comm", "stall-seconds", "stall-seconds-type", "worker-times-freq", "timeout-seconds",
        "op", "op-and-average", "scalar-gather",
        "root", "process-set",
        "scalar-reducescatter", "splits-length", "splits-sum", "tape",
        "v1-optimizer", "passes", "groups", "predivide", "global-variables",
        "global-variables-tf2", "max-of-slices", "adasum-of-slices", "min-of-listed-slices",
        "object-in-function",
        "object-without-session", "join-in-function"])
def test_errors_a_horovod_user_meets(one_process, call, error, message):
    with pytest.raises(error) as info:
        call()
    assert str(info.value).startswith(message), str(info.value)


def test_the_distributed_optimizer_is_a_subclass_of_the_users_class(one_process):
    adam = keras.optimizers.Adam(0.003, beta_1=0.8)
    opt = hvdk.DistributedOptimizer(adam, name="dist")
    assert isinstance(opt, keras.optimizers.Adam) and type(opt).__name__ == "Adam"
    assert opt.name == "dist" and opt.beta_1 == 0.8
    scaled = hvdk.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(adam))
    assert isinstance(scaled, keras.optimizers.LossScaleOptimizer)
    assert isinstance(scaled.inner_optimizer, keras.optimizers.Adam)


def test_a_distributed_optimizers_class_makes_distributed_ones_and_load_model_restores_one(
        one_process, tmp_path):
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                    backward_passes_per_step=2)
    again = type(opt).from_config(opt.get_config())
    assert again.get_config() == opt.get_config() and again._tfreduce_passes_per_step == 2
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), "mse")
    model.fit(np.ones((4, 3)), np.ones((4, 2)), epochs=1, verbose=0)
    model.save(tmp_path / "model.keras")
    loaded = hvdk.load_model(tmp_path / "model.keras")
    assert isinstance(loaded.optimizer, keras.optimizers.SGD)
    assert loaded.optimizer._tfreduce_reduction == model.optimizer._tfreduce_reduction
    saved = [v.numpy() for v in model.optimizer.variables]
    assert len(saved) == 4 and np.abs(saved[2]).max() > 0  # iterations, lr, 2 momenta
    for restored, value in zip(loaded.optimizer.variables, saved):
        np.testing.assert_array_equal(restored.numpy(), value)


@pytest.mark.slow
def test_fit_in_one_process_with_the_callbacks_and_a_schedule(one_process, tmp_path):
    # The schedule multiplies by 0.5 per epoch from epoch 1.
    def run(distributed):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        optimizer = keras.optimizers.SGD(0.1)
        callbacks, rates = [], []
        if distributed:
            optimizer = hvdk.DistributedOptimizer(optimizer)
            callbacks = [hvdk.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvdk.callbacks.MetricAverageCallback(),
                         hvdk.callbacks.LearningRateScheduleCallback(0.1, 0.5, start_epoch=1),
                         hvdk.callbacks.WorkerTimesCallback(tmp_path, update_freq="batch")]
        record = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda b, logs: rates.append(
            float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))))
        model.compile(optimizer=optimizer, loss="mse")
        x = np.random.default_rng(1).normal(size=(16, 4)).astype("float32")
        history = model.fit(x, x[:, :2], batch_size=8, epochs=3, shuffle=False, verbose=0,
                            callbacks=callbacks + [record])
        return model.get_weights(), history.history, rates

    weights, history, rates = run(True)
    plain_rates = run(False)[2]
    assert plain_rates == [pytest.approx(0.1)] * 6
    # Horovod's rule: multiplier ** (epoch - start_epoch) from start_epoch on.
    assert rates == [pytest.approx(r) for r in [0.1, 0.1, 0.1, 0.1, 0.05, 0.05]]
    assert history["learning_rate"] == [pytest.approx(r) for r in (0.1, 0.1, 0.05)]
    np.testing.assert_array_equal(weights[0], run(True)[0][0])  # repeatable
    assert list(tmp_path.iterdir()) == []  # one process: no worker times to draw


def test_the_warmup_rate_per_batch(one_process, monkeypatch):
    # Goyal et al.: from initial_lr / size to initial_lr; with size 4 (as
    # if 4 processes) and 2 steps per epoch over 2 epochs.
    monkeypatch.setattr("tfreduce.tensorflow.keras.callbacks.size", lambda: 4)
    warmup = hvdk.callbacks.LearningRateWarmupCallback(0.8, warmup_epochs=2, steps_per_epoch=2)
    rates = [0.8 / 4 * ((e + (b + 1) / 2) * 3 / 2 + 1) for e in range(2) for b in range(2)]
    assert rates[-1] == pytest.approx(0.8)
    got = []
    warmup.set_model(type("M", (), {"optimizer": keras.optimizers.SGD(0.1)})())
    for e in range(2):
        warmup.on_epoch_begin(e)
        for b in range(2):
            warmup.on_train_batch_begin(b)
            got.append(float(keras.ops.convert_to_numpy(warmup.model.optimizer.learning_rate)))
    assert got == [pytest.approx(r) for r in rates]


# ------------------------------------------------------------------ DistributedBatches

def epoch_of(batches):
    """Begins an epoch and returns all its batches, in the order fit would take them."""
    batches.on_epoch_begin()
    return [batches[i] for i in range(len(batches))]


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_global_batch_is_the_same_for_any_number_of_processes(size):
    x = np.arange(50)[:, None]
    one = hvdk.DistributedBatches(x, None, 12, seed=7, rank=0, size=1)
    parts = [hvdk.DistributedBatches(x, x[:, 0] * 10, 12, seed=7, rank=r, size=size)
             for r in range(size)]
    assert {len(p) for p in parts} == {len(one)} == {4}  # the short last batch dropped
    orders = []
    for _ in range(3):
        whole = epoch_of(one)
        pieces = [epoch_of(p) for p in parts]
        for i in range(len(one)):
            # Each process's part: the shard rule (12 over 3: 4, 4, 4; over 4: 3 each).
            assert [len(piece[i][0]) for piece in pieces] == shard_sizes(12, size)
            assert np.concatenate([piece[i][0] for piece in pieces]).tolist() == \
                whole[i].tolist()
            assert pieces[0][i][1].tolist() == (10 * pieces[0][i][0][:, 0]).tolist()
        orders.append(one.order().tolist())
    assert orders[0] != orders[1] != orders[2] and sorted(orders[0]) == list(range(50))


@pytest.mark.slow
def test_fit_takes_the_batches_in_their_order_whatever_its_shuffle():
    # Keras permutes a PyDataset's batch indices with fit(shuffle=True), with
    # each process's own random state: DistributedBatches serves them in order.
    x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    def run(data, **kwargs):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
        model.fit(*data, epochs=2, verbose=0, **kwargs)
        return model.get_weights()

    batches = hvdk.DistributedBatches(x, y, 16, shuffle=False, rank=0, size=1)
    got = run([batches])  # shuffle=True, fit's default
    want = run([x, y], batch_size=16, shuffle=False)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_padding_counts_every_example_once_and_resumes_at_its_epoch():
    x = np.arange(10)[:, None]
    parts = [hvdk.DistributedBatches(x, x[:, 0], 4, remainder="pad", rank=r, size=2,
                                     initial_epoch=5) for r in range(2)]
    assert len(parts[0]) == 3  # 10 examples: 4 + 4 + 2, padded to 4
    seen = {}
    for p in parts:
        for rows, _, weights in epoch_of(p):
            for row, weight in zip(rows[:, 0], weights):
                seen[row] = seen.get(row, 0) + weight
    assert seen == {row: 1.0 for row in range(10)}
    assert parts[0].epoch == 5
    np.testing.assert_array_equal(parts[0].order(),
                                  np.random.default_rng([0, 5]).permutation(10))


@pytest.mark.parametrize("kwargs, message", [
    ({"y": np.zeros(3)}, "x has 10 examples and y 3: they must match"),
    ({"global_batch_size": 1}, "global_batch_size 1 must be at least the 2 processes and at "
                               "most the 10 examples"),
    ({"remainder": "keep"}, "remainder must be 'drop' or 'pad', got 'keep'"),
    ({"rank": 2}, "rank 2 is not in 0..1"),
    ({"remainder": "pad"}, "remainder='pad' weights the padding 0, which needs targets y"),
])
def test_distributed_batches_errors(kwargs, message):
    options = {"y": None, "global_batch_size": 4, "rank": 0, "size": 2, **kwargs}
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        hvdk.DistributedBatches(np.zeros((10, 2)), options.pop("y"), **options)


# ------------------------------------------------------------------ SLURM

def test_slurm_host_lists_and_task_counts_expand_as_slurm_writes_them():
    assert expand_hostlist("n[01-03,7],gpu") == ["n01", "n02", "n03", "n7", "gpu"]
    assert expand_hostlist("a[1-2]b[3-4]") == ["a1b3", "a1b4", "a2b3", "a2b4"]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    config = slurm_tf_config({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4",
                              "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NODEID": "1",
                              "SLURM_STEP_TASKS_PER_NODE": "2(x2)"})
    assert config == {"cluster": {"worker": ["node1:8888", "node1:8889", "node2:8888",
                                             "node2:8889"]},
                      "task": {"type": "worker", "index": 3}}
    assert slurm_tf_config({}) is None
    # A batch script's shell: SLURM_PROCID and the job's variables, no step.
    assert slurm_tf_config({"SLURM_PROCID": "0", "SLURM_NTASKS": "4",
                            "SLURM_JOB_NODELIST": "node[1-2]"}) is None


@pytest.mark.parametrize("environ, message", [
    ({"SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_NODELIST": "a,b",
      "SLURM_STEP_TASKS_PER_NODE": "1(x2)"},
     "SLURM's 2 nodes ['a', 'b'] with tasks per node [1, 1] do not give "
     "SLURM_STEP_NUM_TASKS=3"),
    ({"SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NODELIST": "a[1-x]",
      "SLURM_STEP_TASKS_PER_NODE": "1"}, "SLURM host list 'a[1-x]': '1-x' is not a number"),
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "a,b", "SLURM_NODEID": "1",
      "SLURM_STEP_TASKS_PER_NODE": "2(x2)"},
     "SLURM task 0 runs on node 1, where block distribution puts it on node 0"),
])
def test_slurm_errors(environ, message):
    environ = dict(environ, SLURM_PROCID="0")
    with pytest.raises(ValueError) as info:
        slurm_tf_config(environ)
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.slow
def test_two_processes_started_as_srun_would_find_each_other():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = ("import tensorflow as tf, tfreduce.tensorflow as hvd\n"
            "hvd.init()\n"
            "print(hvd.rank(), hvd.size(), hvd.allreduce(tf.constant(float(hvd.rank())), "
            "op=hvd.Sum).numpy())\n"
            "hvd.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.update(SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="127.0.0.1",
               SLURM_STEP_TASKS_PER_NODE="2", TFREDUCE_SLURM_PORT_BASE=str(port))
    # Both at once, forked from the warm zygote (no TensorFlow import each).
    done = zygote.run_together([[sys.executable, "-c", code]] * 2,
                               [dict(env, SLURM_PROCID=str(r)) for r in range(2)], timeout=120)
    assert [d.returncode for d in done] == [0, 0], [d.stderr[-2000:] for d in done]
    assert [d.stdout.split() for d in done] == [["0", "2", "1.0"], ["1", "2", "1.0"]]


def test_under_mixed_float16_the_scale_decides_on_the_reduced_gradients(one_process,
                                                                         mixed_float16):
    # compile's own wrapper would check each process's unreduced gradients.
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1))
    assert isinstance(opt, keras.optimizers.LossScaleOptimizer)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, dtype="float32")])
    model.compile(optimizer=opt, loss="mse")
    assert model.optimizer is opt  # not wrapped again


def test_an_embedding_gradient_is_reduced_eagerly_as_indexed_slices(one_process):
    layer = keras.layers.Embedding(10, 3, embeddings_initializer="ones")
    layer.build((None,))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(tf.constant([1, 4, 4])))
    tape = hvd.DistributedGradientTape(tape)
    (grad,) = tape.gradient(loss, layer.trainable_variables)
    assert isinstance(grad, tf.IndexedSlices)
    np.testing.assert_array_equal(tf.convert_to_tensor(grad).numpy().sum(axis=1),
                                  [0, 3, 0, 0, 6, 0, 0, 0, 0, 0])


def test_scale_factors_scale_the_rows_of_indexed_slices(one_process):
    rows = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 4.0]]), tf.constant([0, 3]),
                            tf.constant([5, 2]))
    out = hvd.allreduce(rows, op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0)
    assert isinstance(out, tf.IndexedSlices) and out.indices.numpy().tolist() == [0, 3]
    np.testing.assert_array_equal(out.values.numpy(), [[2.0, 4.0], [6.0, 8.0]])
    # Horovod's gradient_predivide_factor with an embedding's sparse gradient.
    layer = keras.layers.Embedding(6, 2, embeddings_initializer="ones")
    layer.build((None,))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(tf.constant([2, 2])))
    tape = hvd.DistributedGradientTape(tape, gradient_predivide_factor=4.0)
    (grad,) = tape.gradient(loss, layer.trainable_variables)
    np.testing.assert_array_equal(tf.convert_to_tensor(grad).numpy()[2], [2.0, 2.0])


def test_float16_scales_in_float32_with_one_rounding_back(one_process):
    # Horovod's ScaleBuffer: 65 x 0.19151945 is 12.449 in float32, 12.445
    # in float16; with the factor rounded to float16 first it would be 12.45.
    factor = 0.1915194503788923
    x = np.array([65.0, 67.0, 2.0], np.float16)
    want = (x.astype(np.float32) * np.float32(factor)).astype(np.float16)
    assert (want != x * np.float16(factor)).any()  # the two roundings differ here
    for option in ("prescale_factor", "postscale_factor"):
        out = hvd.allreduce(tf.constant(x), op=hvd.Sum, **{option: factor})
        assert out.dtype == tf.float16
        np.testing.assert_array_equal(out.numpy(), want)


@pytest.mark.slow
def test_each_local_rank_sees_its_own_gpu():
    # No GPU here: TensorFlow's device listing is replaced by 4 made-up GPUs,
    # and the choice init() makes for local rank 1 of 2 (on one host) is read.
    code = "\n".join([
        "import json, tensorflow as tf",
        "gpus = [tf.config.PhysicalDevice(f'/physical_device:GPU:{i}', 'GPU') for i in range(4)]",
        "chosen = []",
        "tf.config.list_physical_devices = lambda kind=None: gpus if kind == 'GPU' else []",
        "tf.config.set_visible_devices = lambda devices, kind=None: chosen.append(devices.name)",
        "import tfreduce.workers.cluster",
        "tfreduce.workers.cluster.Cluster.start = lambda self: self  # no server: nothing to reach",
        "import tfreduce.tensorflow as hvd",
        "hvd.init()",
        "print(json.dumps([hvd.local_rank(), chosen]))",
    ])
    config = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
              "task": {"type": "worker", "index": 1}}
    env = dict(os.environ, TF_CONFIG=json.dumps(config))
    done = zygote.run([sys.executable, "-c", code], timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    local_rank, chosen = json.loads(done.stdout.strip().splitlines()[-1])
    assert local_rank == 1 and chosen == ["/physical_device:GPU:1"]


def test_an_elastic_keras_states_restore_undoes_what_came_after_its_last_commit(one_process):
    # Horovod's semantics on one process: sync takes rank 0's (here its own)
    # state as the commit; restore goes back to the last commit; commit keeps
    # what is there now, the optimizer's slots included.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    model.compile(optimizer, "mse")
    model.fit(np.ones((4, 2)), np.ones((4, 2)), verbose=0)
    state = hvdk.elastic.KerasState(model, batch=3, epoch=1)
    state.sync()
    first = [v.numpy() for v in model.variables + optimizer.variables]
    model.fit(np.ones((4, 2)), np.zeros((4, 2)), verbose=0)
    state.batch, state.epoch = 7, 2
    state.restore()
    assert (state.batch, state.epoch) == (3, 1)
    for v, value in zip(model.variables + optimizer.variables, first):
        np.testing.assert_array_equal(v.numpy(), value)
    model.fit(np.ones((4, 2)), np.zeros((4, 2)), verbose=0)
    state.batch = 9
    state.commit()
    second = [v.numpy() for v in model.variables + optimizer.variables]
    model.fit(np.ones((4, 2)), np.ones((4, 2)), verbose=0)
    state.restore()
    assert state.batch == 9 and not np.array_equal(second[0], first[0])
    for v, value in zip(model.variables + optimizer.variables, second):
        np.testing.assert_array_equal(v.numpy(), value)
    calls = []
    state.register_reset_callbacks([lambda: calls.append(hvd.size())])
    state.on_reset()
    assert calls == [1]


@pytest.mark.parametrize("make, error, message", [
    (lambda: hvd.elastic.TensorFlowKerasState(keras.Sequential([keras.layers.Dense(2)])),
     ValueError, "TensorFlowKerasState: build the model first (model.build(input_shape), or "
                 "call it on a batch)"),
    (lambda: hvd.elastic.TensorFlowState([]), ValueError,
     "TensorFlowState needs the list of variables (TF2 has no global variables) and no "
     "session"),
    (lambda: hvdk.elastic.CommitStateCallback(None, batches_per_commit=0), ValueError,
     "CommitStateCallback: batches_per_commit must be an int >= 1, got 0"),
], ids=["unbuilt-model", "no-variables", "commit-every-0"])
def test_elastic_states_refuse_what_they_cannot_keep(one_process, make, error, message):
    with pytest.raises(error) as info:
        make()
    assert str(info.value) == message


def test_an_object_state_outside_the_elastic_launcher_runs_its_function_once(one_process):
    state = hvd.elastic.ObjectState(epoch=0, seen=[])

    @hvd.elastic.run
    def train(state, epochs):
        for state.epoch in range(state.epoch, epochs):
            state.seen.append(state.epoch)
            state.commit()  # no launcher: saved in memory, no host update
        return "done"

    assert train(state, 3) == "done" and state.seen == [0, 1, 2]
    state.seen.append(99)
    state.restore()
    assert state.seen == [0, 1, 2] and state.epoch == 2


XLA_REFUSED = (r"hvd\.{} inside an XLA-compiled function \(tf\.function\(jit_compile=True\), or "
               r"Keras' compile\(jit_compile=True\)\): XLA cannot compile a collective across "
               r"processes\. Compile the forward and backward pass only")


def test_a_collective_inside_an_xla_compiled_function_is_refused_naming_it(one_process):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])

    @tf.function(jit_compile=True)
    def whole_step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        return hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)

    with pytest.raises(ValueError, match=XLA_REFUSED.format("grouped_allreduce")):
        whole_step(tf.ones([4, 3]))
    model.compile(hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse",
                  jit_compile=True)
    with pytest.raises(ValueError, match=XLA_REFUSED.format("grouped_allreduce")):
        model.fit(np.ones((4, 3), np.float32), np.ones((4, 2), np.float32), verbose=0)


def test_the_forward_and_backward_compiled_and_the_allreduce_outside_train(one_process):
    # What the refusal above tells a user to write.
    def run(jit_compile):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        optimizer = keras.optimizers.SGD(0.1)

        @tf.function(jit_compile=jit_compile)
        def forward_backward(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
            return loss, tape.gradient(loss, model.trainable_variables)

        @tf.function
        def step(x, y):
            loss, grads = forward_backward(x, y)
            grads = hvd.grouped_allreduce(grads)
            optimizer.apply(grads, model.trainable_variables)
            return hvd.allreduce(loss)

        x = np.random.default_rng(2).normal(size=(8, 3)).astype(np.float32)
        losses = [float(step(x, x[:, :2])) for _ in range(3)]
        compiled = [op for op in step.get_concrete_function(x, x[:, :2]).graph.get_operations()
                    if op.type == "StatefulPartitionedCall"
                    and "_XlaMustCompile" in op.node_def.attr]
        return losses, [w.numpy() for w in model.weights], compiled

    losses, weights, compiled = run(True)
    plain_losses, plain_weights, _ = run(False)
    assert len(compiled) == 1 and losses[-1] < losses[0]
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
    for got, want in zip(weights, plain_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
