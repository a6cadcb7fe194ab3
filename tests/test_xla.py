"""jit_compile: each tower's forward and backward pass one XLA cluster on its device.

The same bits for any K with deterministic=True: tests/test_determinism.py.
"""

import types
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfreduce
from helpers import CPU_DEVICES
from tfreduce.trainer.compiled import TowerPasses, resolve_jit_compile, uncompilable
from tfreduce.trainer.losses import per_example_loss_fn

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mlp():
    # BatchNormalization and Dropout compiled: tests/test_determinism.py (its CNN).
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="relu"),
                             keras.layers.Dense(4)])


def data(n=24):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 6)).astype(np.float32), rng.integers(0, 4, n)


def trainer(jit_compile, k=2, model_fn=mlp, **options):
    keras.utils.set_random_seed(3)
    return tfreduce.ReplicatedTrainer(model_fn, LOSS, lambda: keras.optimizers.SGD(0.05),
                                      devices=CPU_DEVICES[:k], algorithm="flat",
                                      jit_compile=jit_compile, **options)


def compiled_calls(graph):
    return [op for op in graph.get_operations() if op.type == "StatefulPartitionedCall"
            and "_XlaMustCompile" in op.node_def.attr and op.get_attr("_XlaMustCompile")]


@pytest.mark.parametrize("k", [2, 4])
def test_each_tower_is_one_compiled_cluster_on_its_device_and_the_reduction_is_outside(k):
    run = trainer(True, k, lambda: keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)]))
    run.train_step(np.ones((8, 5), np.float32), np.zeros(8, np.int64))
    graph = run.step_graphs()["train"]
    calls = compiled_calls(graph)
    assert [op.device for op in calls] == CPU_DEVICES[:k]
    reduction = [op for op in graph.get_operations() if op.name.startswith("allreduce_flat")]
    assert reduction and all(op.device in CPU_DEVICES[:k] for op in reduction)
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    for op in calls:
        body = library[op.get_attr("f").name].node_def
        kinds = {node.op for node in body}
        # Forward, loss and backward only: no collective, no update, no other device.
        assert "MatMul" in kinds and "BiasAddGrad" in kinds
        assert not {kind for kind in kinds if "Assign" in kind or "Collective" in kind
                    or kind.startswith("ResourceApply")}
        assert not any(node.name.startswith("allreduce") for node in body)
        assert {node.device for node in body} == {""}
    # The reduction reads the compiled calls' outputs (the gradients).
    assert set(calls) <= ancestors(reduction)


def ancestors(ops):
    """Every op whose outputs the ops read, transitively."""
    seen, todo = set(), list(ops)
    while todo:
        for t in todo.pop().inputs:
            if t.op not in seen:
                seen.add(t.op)
                todo.append(t.op)
    return seen


def test_compiled_towers_train_to_the_uncompiled_weights_within_float32_rounding():
    x, y = data()
    runs = {}
    for jit in (False, True):
        run = trainer(jit)
        losses = [run.train_step(x, y) for _ in range(2)]
        assert run.check_replicas() == 0.0  # the towers stay bit-identical
        runs[jit] = losses, [v.numpy() for v in run.models[0].variables]
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-5)
    for got, want in zip(runs[True][1], runs[False][1]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert any(not np.array_equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))


def test_an_embedding_and_a_dict_of_inputs_compile_with_their_sparse_gradients():
    def model_fn():
        ids = keras.Input((3,), name="ids", dtype="int32")
        scale = keras.Input((1,), name="scale")
        hidden = keras.layers.Flatten()(keras.layers.Embedding(10, 2)(ids))
        out = keras.layers.Dense(2)(keras.layers.Concatenate()([hidden, scale]))
        return keras.Model({"ids": ids, "scale": scale}, out)

    x = {"ids": np.arange(24).reshape(8, 3) % 10, "scale": np.ones((8, 1), np.float32)}
    y = np.arange(8) % 2
    runs = [trainer(jit, model_fn=model_fn) for jit in (False, True)]
    losses = [[run.train_step(x, y) for _ in range(2)] for run in runs]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
    assert runs[1].check_replicas() == 0.0 and compiled_calls(runs[1].step_graphs()["train"])


def test_mixed_precision_towers_compile_with_their_loss_scale_on_their_device():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        run = trainer(True)
        x, y = data()
        losses = [run.train_step(x, y)]
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert np.isfinite(losses).all() and run.check_replicas() == 0.0
    assert [o.dynamic_scale.value.device[-5:] for o in run.optimizers] == ["CPU:0", "CPU:1"]


def with_py_function():
    model = mlp()
    return keras.Sequential([model, keras.layers.Lambda(
        lambda t: t + tf.ensure_shape(tf.numpy_function(np.zeros_like, [t], t.dtype), t.shape))])


def test_an_op_xla_cannot_compile_raises_naming_it_with_jit_compile_true():
    x, y = data()
    run = trainer(True, model_fn=with_py_function)
    for _ in range(2):  # the next step raises again
        with pytest.raises(ValueError, match=r"XLA cannot compile the towers' forward and "
                                             r"backward pass: PyFunc\. Pass jit_compile=False"):
            run.train_step(x, y)


def test_auto_warns_once_naming_the_op_and_runs_the_towers_uncompiled():
    model = with_py_function()
    model.build((None, 6))
    towers = types.SimpleNamespace(models=[model], optimizers=[keras.optimizers.SGD(0.1)],
                                   trainable=[model.trainable_variables])
    passes = TowerPasses(towers, per_example_loss_fn(LOSS), lambda loss, reg: loss + reg, "auto")
    x, y = data(4)
    step = tf.function(lambda x, y: passes(0, x, y)[1], autograph=False)
    with pytest.warns(UserWarning, match=r"XLA cannot compile .*: PyFunc\. The towers run "
                                         r"uncompiled \(jit_compile=\"auto\"\)"):
        loss = step(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = step(tf.constant(x[:2]), y[:2])  # a new trace: no second warning
    assert not passes.compiled and np.isfinite([loss, again]).all()
    assert not compiled_calls(step.get_concrete_function(x, y).graph)


def test_uncompilable_names_the_missing_kernel_and_passes_a_compilable_function():
    @tf.function(jit_compile=True, autograph=False)
    def bad(t):
        return tf.strings.to_number(tf.strings.as_string(t))

    assert uncompilable(bad, (tf.ones([2]),)) == "AsString"  # the first op XLA meets
    dynamic = tf.function(lambda t: tf.range(tf.cast(tf.reduce_max(t), tf.int32)),
                          jit_compile=True, autograph=False)
    assert uncompilable(dynamic, (tf.ones([2]),)) == (
        "Input 1 to node `range` with op Range must be a compile-time constant.")
    good = tf.function(lambda t: t * 2.0, jit_compile=True, autograph=False)
    assert uncompilable(good, (tf.TensorSpec([None, 3], tf.float32),)) is None


def test_jit_compile_takes_true_false_or_auto_and_auto_is_on_for_gpus_only():
    with pytest.raises(TypeError, match=r'jit_compile must be True, False or "auto", got str '
                                        r"'yes'"):
        trainer("yes")
    assert resolve_jit_compile("auto", ["/device:GPU:0", "/device:GPU:1"]) == "auto"
    assert resolve_jit_compile("auto", ["/device:GPU:0", "/device:CPU:0"]) is False
    with pytest.raises(TypeError, match="got int 1"):
        resolve_jit_compile(1, CPU_DEVICES[:2])
    run = trainer("auto")
    run.train_step(*data())
    assert not compiled_calls(run.step_graphs()["train"])  # CPU towers: uncompiled
