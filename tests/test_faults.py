"""Hostile input that once gave a silent wrong result or a crash: now a right result or an error."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfreduce
from helpers import CPU_DEVICES, GPU_DEVICES, placeholders

CPU_ALGORITHMS = ["flat", "hierarchical", "ring", "collective"]


def run_with_signature(algorithm, shapes, values, **options):
    """Reduces 2 towers in a tf.function whose inputs have the static shapes given.

    shapes: per tower, the TensorSpec shape; values: per tower, the array fed.
    """
    devices = CPU_DEVICES[:2]
    specs = [tf.TensorSpec(s, tf.float32) for s in shapes]

    @tf.function(input_signature=specs, autograph=False)
    def step(*grads):
        placed = []
        for g, d in zip(grads, devices):
            with tf.device(d):
                placed.append([tf.identity(g)])
        return tfreduce.allreduce_grads(placed, devices, algorithm=algorithm, **options)

    return step(*[tf.constant(v, tf.float32) for v in values])


@pytest.mark.parametrize("algorithm", CPU_ALGORITHMS)
def test_shapes_known_only_at_run_time_are_compared_there(algorithm):
    # Once: the ring broadcast the chunks and tower 0 got 4 elements back.
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="variable 0: tower 1 has another shape than tower 0"):
        run_with_signature(algorithm, [[None], [None]], [np.ones(3), np.ones(4)])
    out = run_with_signature(algorithm, [[None], [None]], [np.ones(3), 2 * np.ones(3)])
    for row in out:
        np.testing.assert_array_equal(row[0].numpy(), [3.0, 3.0, 3.0])


def test_packing_never_cuts_a_tower_at_another_towers_static_shape():
    # Tower 0 static (2, 3), tower 1 (3, 2) known only at run time: packing
    # at tower 0's sizes once reshaped tower 1's gradient silently.
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="variable 0: tower 1 has another shape than tower 0"):
        run_with_signature("flat", [[2, 3], [None, None]], [np.ones((2, 3)), np.ones((3, 2))],
                           pack_bytes=1024)


def test_a_dense_and_a_sparse_tower_of_other_shapes_are_refused():
    devices = GPU_DEVICES[:2]
    with tf.Graph().as_default():
        with tf.device(devices[0]):
            sparse = tf.IndexedSlices(tf.ones([2, 4]), tf.constant([0, 1]), tf.constant([5, 4]))
        with tf.device(devices[1]):
            dense = tf.ones([5, 3])
        for algorithm in ("flat", "ring"):
            with pytest.raises(ValueError, match=re.escape(
                    "variable 0: tower 1 has shape (5, 3), tower 0 has (5, 4)")):
                tfreduce.allreduce_grads([[sparse], [dense]], devices, algorithm=algorithm)


def test_indexed_slices_of_different_dense_shapes_are_refused():
    devices = GPU_DEVICES[:2]
    with tf.Graph().as_default():
        rows = []
        for d, vocabulary in zip(devices, (5, 6)):
            with tf.device(d):
                rows.append([tf.IndexedSlices(tf.ones([2, 4]), tf.constant([0, 1]),
                                              tf.constant([vocabulary, 4]))])
        with pytest.raises(ValueError, match=re.escape(
                "variable 0: tower 1 has shape (6, 4), tower 0 has (5, 4)")):
            tfreduce.allreduce_grads(rows, devices)


@pytest.mark.parametrize("option", ["average", "sparse_as_dense"])
@pytest.mark.parametrize("value", ["no", "False", [0], 1, None])
def test_flags_must_be_bools(option, value):
    devices = GPU_DEVICES[:2]
    with tf.Graph().as_default() as graph:
        grads = placeholders(devices, [(3,)])
        with pytest.raises(TypeError, match=re.escape(
                f"{option} must be True or False, got {type(value).__name__} {value!r}")):
            tfreduce.allreduce_grads(grads, devices, **{option: value})
        assert not [op for op in graph.get_operations() if op.type == "AddN"]
        tfreduce.allreduce_grads(grads, devices, average=np.bool_(True))  # NumPy's bool


@pytest.mark.parametrize("dtype", [tf.bool, tf.string, tf.complex64])
def test_gradients_that_cannot_be_summed_are_refused(dtype):
    devices = GPU_DEVICES[:2]
    with tf.Graph().as_default():
        grads = placeholders(devices, [(3,), ((2,), dtype)])
        with pytest.raises(TypeError, match=re.escape(
                f"variable 1: gradients of dtype {dtype.name} cannot be all-reduced")):
            tfreduce.allreduce_grads(grads, devices)


@pytest.mark.parametrize("shape", [[0, 3], [0], [3, 0]])
@pytest.mark.parametrize("pack_bytes", [None, 1024])
def test_zero_size_gradients_through_every_algorithm(shape, pack_bytes):
    # Once: SIGSEGV inside TF's collective kernel.
    for algorithm in CPU_ALGORITHMS:
        for devices in (CPU_DEVICES[:2], CPU_DEVICES[:3]):
            grads = []
            for d in devices:
                with tf.device(d):
                    grads.append([tf.zeros(shape), tf.ones([2])])
            out = tfreduce.allreduce_grads(grads, devices, algorithm=algorithm,
                                           pack_bytes=pack_bytes, average=True)
            for k, row in enumerate(out):
                assert row[0].shape == shape and row[0].device.endswith(devices[k])
                np.testing.assert_array_equal(row[1].numpy(), [1.0, 1.0])


def test_zero_size_known_only_at_run_time_through_collective_ops():
    out = run_with_signature("collective", [[None, 3], [None, 3]],
                             [np.ones((0, 3)), np.ones((0, 3))])
    assert [row[0].shape for row in out] == [(0, 3), (0, 3)]
    out = run_with_signature("collective", [[None], [None]], [np.ones(2), np.ones(2)])
    np.testing.assert_array_equal(out[1][0].numpy(), [2.0, 2.0])


@pytest.mark.parametrize("options, error, message", [
    ({"timeout": "5"}, ValueError, "timeout must be a number of seconds > 0 or None "
                                   "(wait forever), got '5'"),
    ({"keys": "abc"}, TypeError, "keys must be a tfreduce.CollectiveKeys or None, got str 'abc'"),
])
def test_bad_collective_option_types(options, error, message):
    devices = GPU_DEVICES[:2]
    with tf.Graph().as_default():
        grads = placeholders(devices, [(3,)])
        with pytest.raises(error, match=re.escape(message)):
            tfreduce.allreduce_grads(grads, devices, algorithm="collective", **options)


def make_model():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


@pytest.mark.parametrize("kwargs, error, message", [
    ({"algorithm": "flat", "groups": [[0], [1]]}, TypeError,
     "algorithm 'flat' takes no option ['groups']"),
    ({"algorithm": "hierarchical", "groups": [[0]]}, ValueError,
     "groups [[0]] leave device indices [1] out"),
    ({"pack_bytes": -1}, ValueError, "pack_bytes must be >= 0 bytes, got -1"),
    ({"sparse_as_dense": "yes"}, TypeError, "sparse_as_dense must be True or False"),
    ({"average": "yes"}, TypeError, "average must be True or False, got str 'yes'"),
    ({"algorithm": "nccl"}, ValueError, "NCCL runs only on GPUs"),
])
def test_the_trainer_checks_all_reduce_options_when_built(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        tfreduce.ReplicatedTrainer(make_model, "mse", lambda: keras.optimizers.SGD(0.1),
                                   devices=CPU_DEVICES[:2], cluster=None, **kwargs)


@pytest.mark.parametrize("algorithm, dtype", [("nccl", tf.bfloat16), ("collective", tf.int8)])
def test_a_dtype_the_engine_cannot_sum_is_named(algorithm, dtype):
    devices = GPU_DEVICES[:2]
    with tf.Graph().as_default():
        grads = placeholders(devices, [(3,), ((2,), dtype)])
        with pytest.raises(TypeError, match=re.escape(
                f"variable 1: algorithm {algorithm!r} cannot reduce {dtype.name} gradients")):
            tfreduce.allreduce_grads(grads, devices, algorithm=algorithm)


@pytest.mark.parametrize("kwargs, message", [
    ({"epochs": 0}, "fit: epochs must be an int >= 1"),
    ({"epochs": -1}, "fit: epochs must be an int >= 1"),
    ({"validation_data": np.zeros((4, 3))},
     "fit: validation_data must be (x, y) or (x, y, sample_weight) arrays"),
    ({"validation_data": (np.zeros((4, 3)), np.zeros((3, 2)))},
     "fit: validation_data: x has 4 examples but y has 3"),
    ({"checkpoint_dir": "FILE/ckpt"}, "fit: checkpoint_dir"),
    # Once TensorFlow's bare FailedPreconditionError ("Not a directory").
    ({"logdir": "FILE"}, "fit: logdir 'FILE' is a file: TensorBoard's summaries (and a "
                         "profile's timeline) are written in a directory"),
])
def test_fit_refuses_bad_arguments_before_the_first_step(tmp_path, kwargs, message):
    blocker = tmp_path / "file"
    blocker.write_text("in the way")
    if kwargs.get("checkpoint_dir") == "FILE/ckpt":
        kwargs = {"checkpoint_dir": str(blocker / "ckpt")}
    if kwargs.get("logdir") == "FILE":
        kwargs, message = {"logdir": str(blocker)}, message.replace("FILE", str(blocker))
    trainer = tfreduce.ReplicatedTrainer(make_model, "mse", lambda: keras.optimizers.SGD(0.1),
                                         devices=CPU_DEVICES[:2], cluster=None)
    x, y = np.zeros((8, 3), np.float32), np.zeros((8, 2), np.float32)
    with pytest.raises(ValueError, match=re.escape(message)):
        trainer.fit(x, y, batch_size=4, verbose=0, **kwargs)
    assert trainer.step == 0


def classifier():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])


def test_fractional_labels_for_class_indices_are_refused_and_whole_ones_count():
    # Once: a sparse loss truncated 0.5 to class 0 and accuracy vanished.
    trainer = tfreduce.ReplicatedTrainer(
        classifier, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        lambda: keras.optimizers.SGD(0.1), devices=CPU_DEVICES[:2], cluster=None)
    x = np.ones((4, 3), np.float32)
    with pytest.raises(ValueError, match=re.escape(
            "train_step: the loss takes class indices, but y holds 0.5")):
        trainer.train_step(x, np.array([0.0, 0.5, 1.0, 2.0], np.float32))
    history = trainer.fit(x, np.array([0.0, 1.0, 3.0, 2.0], np.float32), batch_size=4,
                          verbose=0)
    assert 0.0 <= history["accuracy"][0] <= 1.0
