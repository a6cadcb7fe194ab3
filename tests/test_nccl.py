"""NCCL: structure is tested in test_structure; numerics need GPUs."""

import numpy as np
import pytest
import tensorflow as tf

import tfreduce

GPUS = tf.config.list_logical_devices("GPU")


@pytest.mark.skipif(len(GPUS) < 2, reason="needs 2 GPUs: NCCL kernels exist only on GPUs")
@pytest.mark.parametrize("average", [False, True])
def test_nccl_exact_values_on_gpus(average):
    devices = [d.name for d in GPUS]
    arrays = [[np.full((5,), k + 1.0, np.float32), np.float32(2.0 * k)]
              for k in range(len(devices))]

    @tf.function(autograph=False)
    def step():
        grads = []
        for k, d in enumerate(devices):
            with tf.device(d):
                grads.append([tf.constant(a) for a in arrays[k]])
        return tfreduce.allreduce_grads_nccl(grads, average=average, devices=devices)

    scale = 1.0 / len(devices) if average else 1.0
    for row in step():
        np.testing.assert_array_equal(row[0].numpy(),
                                      np.sum([a[0] for a in arrays], 0) * np.float32(scale))
        assert row[1].numpy() == np.float32(sum(a[1] for a in arrays) * np.float32(scale))
