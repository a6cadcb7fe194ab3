"""The dispatcher: names, the "auto" choice, and option passing."""

import numpy as np
import pytest
import tensorflow as tf

import tfreduce
from helpers import CPU_DEVICES, GPU_DEVICES


def test_algorithm_names():
    assert tfreduce.ALGORITHMS[0] == "auto"
    assert {"flat", "hierarchical", "nccl", "collective"} <= set(tfreduce.ALGORITHMS)


@pytest.mark.parametrize("devices, want", [
    (GPU_DEVICES[:8], "nccl"),
    (GPU_DEVICES[:1], "flat"),
    (CPU_DEVICES[:4], "flat"),
    ([GPU_DEVICES[0], CPU_DEVICES[1]], "flat"),
])
def test_auto_choice(devices, want):
    assert tfreduce.choose_algorithm(devices) == want


def test_auto_on_gpus_builds_nccl():
    with tf.Graph().as_default() as graph:
        grads = []
        for d in GPU_DEVICES[:2]:
            with tf.device(d):
                grads.append([tf.zeros([3])])
        tfreduce.allreduce_grads(grads, ["/gpu:0", "/gpu:1"])
    assert [op.type for op in graph.get_operations()].count("NcclAllReduce") == 2


def test_options_reach_the_algorithm():
    devices = CPU_DEVICES[:4]

    @tf.function(autograph=False)
    def step():
        grads = []
        for k, d in enumerate(devices):
            with tf.device(d):
                grads.append([tf.fill([3], float(k)), tf.fill([2], 1.0)])
        out = tfreduce.allreduce_grads(grads, devices, algorithm="hierarchical",
                                       groups=[[0], [1, 2, 3]], pack_bytes=1024)
        return out

    graph = step.get_concrete_function().graph
    names = [op.name for op in graph.get_operations()]
    assert any(n.endswith("entry0_group1_sum") for n in names)
    assert not any("entry1_" in n for n in names)  # both packed into entry 0
    for row in step():
        np.testing.assert_array_equal(row[0].numpy(), [6.0, 6.0, 6.0])
        np.testing.assert_array_equal(row[1].numpy(), [4.0, 4.0])
