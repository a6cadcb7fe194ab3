"""Cross-check against tensorpack's allreduce_grads_hierarchical (K=8)."""

import numpy as np
import pytest
import tensorflow as tf

import tfreduce
from helpers import CPU_DEVICES, v1_session_config

tensorpack_utils = pytest.importorskip(
    "tensorpack.graph_builder.utils", reason="needs tensorpack (pip install tfreduce[test])")

SHAPES = [(), (5,), (3, 4), (2, 3, 4), (64,), (7, 7), (1,), (9, 2)]


@pytest.mark.parametrize("average", [False, True])
def test_hierarchical_equals_tensorpack_for_k8(average):
    rng = np.random.default_rng(8)
    arrays = [[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(8)]
    graph = tf.Graph()
    with graph.as_default():
        grads = []
        for k, d in enumerate(CPU_DEVICES):
            with tf.device(d):
                grads.append([tf.constant(a) for a in arrays[k]])
        # Unpacked, so that both build one reduction per variable.
        ours = tfreduce.allreduce_grads_hierarchical(grads, CPU_DEVICES, average=average,
                                                     pack_bytes=None)
        theirs = tensorpack_utils.allreduce_grads_hierarchical(grads, CPU_DEVICES,
                                                               average=average)
        with tf.compat.v1.Session(graph=graph, config=v1_session_config()) as sess:
            ours_v, theirs_v = sess.run([ours, [list(row) for row in theirs]])
    eps = np.finfo(np.float32).eps
    scale = 0.125 if average else 1.0
    for k in range(8):
        for n in range(len(SHAPES)):
            # tensorpack sums each group with one add_n and adds the two
            # group sums; tfreduce's combining root adds its own group's 4
            # gradients and the other group's sum in one add_n (one pass
            # fewer). Either sum of 8 terms is within 7 eps sum|x| of the
            # exact one, so they are within twice that of each other (1/8
            # is exact).
            bound = 14 * eps * np.sum([np.abs(a[n]) for a in arrays], axis=0) * scale
            assert np.all(np.abs(ours_v[k][n] - theirs_v[k][n]) <= bound), (k, n)
            np.testing.assert_array_equal(ours_v[k][n], ours_v[0][n])  # one result for all
    np.testing.assert_allclose(
        ours_v[3][4], np.sum([a[4] for a in arrays], axis=0) * (0.125 if average else 1.0),
        rtol=1e-5)


def test_tensorpack_split_merge_layout_matches():
    pairs = [[("g%d%d" % (k, n), "v%d" % n) for n in range(3)] for k in range(2)]
    assert tfreduce.split_grad_list(pairs) == tuple(
        [list(map(list, x)) for x in tensorpack_utils.split_grad_list(pairs)])
