"""Overlap of the reduction with the backward pass: buckets in backward order.

The trainer's step is read as a graph (nothing about time is asserted
here): each bucket's reduction must depend on its own gradients only, so
TensorFlow's executor can start it as soon as the backward pass has
produced them.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import CPU_DEVICES
from test_trainer import LOSS, sgd
from tfreduce.trainer import ReplicatedTrainer


def deep_mlp():
    """Four float32 Dense layers, 8 trainable variables of 64 to 1,024 bytes."""
    return keras.Sequential([keras.Input((8,))]
                            + [keras.layers.Dense(16, activation="relu") for _ in range(3)]
                            + [keras.layers.Dense(4)])


def gradient_ancestors(graph, marked):
    """{op: set of variable indices whose gradient is among op's ancestors (or op itself)}.

    marked: {op: variable index} of the ops that output a tower's gradient.
    """
    found = {}
    for op in graph.get_operations():  # creation order: inputs come first
        seen = {marked[op]} if op in marked else set()
        for dep in [t.op for t in op.inputs] + list(op.control_inputs):
            seen |= found.get(dep, set())
        found[op] = seen
    return found


def traced_step(algorithm, monkeypatch, **options):
    """A trained step's graph and {gradient op: variable index} of every tower."""
    marked = {}
    original = tf.GradientTape.gradient

    def recording(tape, target, sources, *args, **kwargs):
        grads = original(tape, target, sources, *args, **kwargs)
        for n, g in enumerate(grads):
            marked[g.op] = n
        return grads

    monkeypatch.setattr(tf.GradientTape, "gradient", recording)
    trainer = ReplicatedTrainer(deep_mlp, LOSS, sgd, devices=CPU_DEVICES[:4],
                                algorithm=algorithm, **options)
    rng = np.random.default_rng(0)
    trainer.train_step(rng.normal(size=(16, 8)).astype("float32"), rng.integers(0, 4, 16))
    monkeypatch.undo()
    graph = trainer._steps._train_fns[True].get_concrete_function().graph
    return graph, {op: n for op, n in marked.items() if op.graph is graph}


@pytest.mark.parametrize("algorithm", ["flat", "ring", "hierarchical"])
def test_each_bucket_reduction_depends_only_on_its_own_gradients(algorithm, monkeypatch):
    # pack_bytes=400, backward order: [7, 6, 5, 3] (16 + 256 + 64 + 64
    # bytes), 4 and 2 (1,024-byte kernels) passed through, [1] (464 > 400
    # opens another), 0 (512) passed through. The buckets are read from
    # the graph: the largest sets of gradients some reduction op reads.
    graph, marked = traced_step(algorithm, monkeypatch, pack_bytes=400)
    assert sorted(set(marked.values())) == list(range(8))
    ancestors = gradient_ancestors(graph, marked)
    reduction = [op for op in graph.get_operations() if "allreduce_" in op.name]
    sets = [ancestors[op] for op in reduction if ancestors[op]]
    buckets = {frozenset(s) for s in sets if not any(s < other for other in sets)}
    # Every reduction op reads the gradients of one bucket only: the
    # largest sets do not overlap.
    assert sorted(map(sorted, buckets)) == [[0], [1], [2], [3, 5, 6, 7], [4]]
    assert sum(len(b) for b in buckets) == len(set().union(*buckets)) == 8
    # The first bucket (pack 0 of tower 0) holds the last variable and does
    # not wait for the first layer's gradients (its kernel 0 and bias 1).
    first = next(op for op in reduction if op.name.endswith("dev0_pack0"))
    assert ancestors[first] == {3, 5, 6, 7}
