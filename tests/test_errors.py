"""Bad input gets a ValueError/TypeError naming the tower, variable and values."""

import re

import pytest
import tensorflow as tf

import tfreduce
from helpers import CPU_DEVICES, GPU_DEVICES


def grads_on(devices, shapes, dtype=tf.float32):
    out = []
    for d in devices:
        with tf.device(d):
            out.append([tf.zeros(s, dtype) for s in shapes])
    return out


@pytest.fixture
def graph():
    with tf.Graph().as_default() as g:
        yield g


ALL = ["flat", "hierarchical", "ring", "collective", "nccl"]


@pytest.mark.parametrize("algorithm", ALL)
def test_towers_and_devices_differ(graph, algorithm):
    grads = grads_on(GPU_DEVICES[:3], [(2,)])
    with pytest.raises(ValueError, match=re.escape(
            "all_grads has 3 towers but 2 devices were given (['/gpu:0', '/gpu:1'])")):
        tfreduce.allreduce_grads(grads, ["/gpu:0", "/gpu:1"], algorithm=algorithm)


@pytest.mark.parametrize("algorithm", ALL)
def test_ragged_n(graph, algorithm):
    grads = grads_on(GPU_DEVICES[:3], [(2,), (3,)])
    grads[2].pop()
    with pytest.raises(ValueError, match="tower 2 has 1 gradients, tower 0 has 2"):
        tfreduce.allreduce_grads(grads, GPU_DEVICES[:3], algorithm=algorithm)


def test_shape_mismatch(graph):
    grads = grads_on(GPU_DEVICES[:2], [(2,), (3, 4)])
    with tf.device(GPU_DEVICES[1]):
        grads[1][1] = tf.zeros((4, 3))
    with pytest.raises(ValueError, match=re.escape(
            "variable 1: tower 1 has shape (4, 3), tower 0 has (3, 4)")):
        tfreduce.allreduce_grads_flat(grads, GPU_DEVICES[:2])


def test_dtype_mismatch(graph):
    grads = grads_on(GPU_DEVICES[:3], [(2,)])
    grads[2][0] = tf.zeros((2,), tf.float16)
    with pytest.raises(ValueError, match="variable 0: tower 2 has dtype float16, "
                                         "tower 0 has float32"):
        tfreduce.allreduce_grads_hierarchical(grads, GPU_DEVICES[:3])


def test_none_on_some_towers_only(graph):
    grads = grads_on(GPU_DEVICES[:4], [(2,), (3,)])
    grads[1][1] = None
    grads[3][1] = None
    with pytest.raises(ValueError, match=re.escape(
            "variable 1: the gradient is None on towers [1, 3] but not on towers [0, 2]")):
        tfreduce.allreduce_grads_flat(grads, GPU_DEVICES[:4])


def test_not_a_gradient(graph):
    grads = grads_on(GPU_DEVICES[:2], [(2,)])
    grads[1][0] = [1.0, 2.0]
    with pytest.raises(TypeError, match="tower 1, variable 0: a gradient must be a "
                                        "tf.Tensor, tf.IndexedSlices or None, got list"):
        tfreduce.allreduce_grads_flat(grads, GPU_DEVICES[:2])


def test_tower_is_not_a_list(graph):
    grads = grads_on(GPU_DEVICES[:2], [(2,)])
    grads[1] = grads[1][0]
    with pytest.raises(TypeError, match=r"all_grads\[1\] \(tower 1\) must be a list of N "
                                        r"gradients, got (Symbolic)?Tensor"):
        tfreduce.allreduce_grads_flat(grads, GPU_DEVICES[:2])


def test_duplicate_devices(graph):
    grads = grads_on(GPU_DEVICES[:3], [(2,)])
    with pytest.raises(ValueError, match=re.escape(
            "devices[0] ('/gpu:1') and devices[2] ('GPU:1') are the same device "
            "'/device:GPU:1'")):
        tfreduce.allreduce_grads_flat(grads, ["/gpu:1", "/gpu:0", "GPU:1"])


def test_malformed_device(graph):
    grads = grads_on(GPU_DEVICES[:2], [(2,)])
    with pytest.raises(ValueError, match=re.escape(
            "devices[1] 'gpu1' is not a valid device string")):
        tfreduce.allreduce_grads_flat(grads, ["/gpu:0", "gpu1"])


def test_device_without_index(graph):
    grads = grads_on(GPU_DEVICES[:2], [(2,)])
    with pytest.raises(ValueError, match=re.escape(
            "devices[1] '/gpu:*' does not name one device")):
        tfreduce.allreduce_grads_flat(grads, ["/gpu:0", "/gpu:*"])


def test_device_not_a_string(graph):
    grads = grads_on(GPU_DEVICES[:2], [(2,)])
    with pytest.raises(TypeError, match=re.escape(
            "devices[1] must be a device string such as '/gpu:0', got int 1")):
        tfreduce.allreduce_grads_flat(grads, ["/gpu:0", 1])


def test_devices_none_without_placement(graph):
    grads = [[tf.zeros((2,))], [tf.zeros((2,))]]
    with pytest.raises(ValueError, match="devices=None, but the gradients of tower 0 carry "
                                         "no device"):
        tfreduce.allreduce_grads_flat(grads)


@pytest.mark.parametrize("groups, message", [
    ([[0, 1], [1, 2, 3]], "device index 1 is in groups[0] and groups[1]"),
    ([[0, 1], [2]], "groups [[0, 1], [2]] leave device indices [3] out"),
    ([[0, 1, 2, 3, 4]], "groups[0] holds device index 4, outside 0..3 for 4 devices"),
    ([[0, 1], []], "groups[1] is empty"),
])
def test_bad_groups(graph, groups, message):
    grads = grads_on(GPU_DEVICES[:4], [(2,)])
    with pytest.raises(ValueError, match=re.escape(message)):
        tfreduce.allreduce_grads_hierarchical(grads, GPU_DEVICES[:4], groups=groups)


def test_groups_not_lists(graph):
    grads = grads_on(GPU_DEVICES[:4], [(2,)])
    with pytest.raises(TypeError, match=re.escape("groups[1] must be a list of device "
                                                  "indices, got 3")):
        tfreduce.allreduce_grads_hierarchical(grads, GPU_DEVICES[:4], groups=[[0, 1, 2], 3])


def test_empty_input(graph):
    with pytest.raises(ValueError, match="all_grads is empty"):
        tfreduce.allreduce_grads([], [])
    with pytest.raises(ValueError, match="tower 0 has no gradients"):
        tfreduce.allreduce_grads([[], []], GPU_DEVICES[:2])


def test_unknown_algorithm(graph):
    grads = grads_on(GPU_DEVICES[:2], [(2,)])
    with pytest.raises(ValueError, match=re.escape(
            "unknown all-reduce algorithm 'butterfly'; choose one of " + str(
                tfreduce.ALGORITHMS))):
        tfreduce.allreduce_grads(grads, GPU_DEVICES[:2], algorithm="butterfly")


def test_option_the_algorithm_does_not_take(graph):
    grads = grads_on(GPU_DEVICES[:2], [(2,)])
    with pytest.raises(TypeError, match=re.escape(
            "algorithm 'flat' takes no option ['groups']")):
        tfreduce.allreduce_grads(grads, GPU_DEVICES[:2], algorithm="flat", groups=[[0, 1]])


def test_nccl_on_cpu_devices_fails_at_build_time(graph):
    grads = grads_on(CPU_DEVICES[:2], [(2,)])
    with pytest.raises(ValueError, match=re.escape(
            "NCCL runs only on GPUs, but devices ['/device:CPU:0', '/device:CPU:1'] "
            "are not GPUs")):
        tfreduce.allreduce_grads_nccl(grads, devices=CPU_DEVICES[:2])
    assert not [op for op in graph.get_operations() if op.type == "NcclAllReduce"]


def test_average_of_integer_gradients(graph):
    grads = grads_on(GPU_DEVICES[:2], [(2,), (3,)], dtype=tf.int32)
    with pytest.raises(TypeError, match="variable 0: average=True needs floating "
                                        "gradients, got int32"):
        tfreduce.allreduce_grads_flat(grads, GPU_DEVICES[:2], average=True)


def test_bad_pack_bytes(graph):
    grads = grads_on(GPU_DEVICES[:2], [(2,)])
    with pytest.raises(ValueError, match="pack_bytes must be >= 0 bytes, got -1"):
        tfreduce.allreduce_grads_flat(grads, GPU_DEVICES[:2], pack_bytes=-1)
    with pytest.raises(TypeError, match="pack_bytes must be an int number of bytes"):
        tfreduce.allreduce_grads_flat(grads, GPU_DEVICES[:2], pack_bytes=1.5)


def test_bad_collective_options(graph):
    grads = grads_on(GPU_DEVICES[:2], [(2,)])
    with pytest.raises(ValueError, match=re.escape(
            "communication must be one of ('auto', 'ring', 'nccl'), got 'mpi'")):
        tfreduce.allreduce_grads_collective(grads, GPU_DEVICES[:2], communication="mpi")
    # One rule for every collective's timeout (collective.check_timeout):
    # seconds > 0, or None for the default; TF's "0 waits forever" is refused.
    for timeout in (-2, 0):
        with pytest.raises(ValueError, match=re.escape(
                f"timeout must be a number of seconds > 0 or None (wait forever), "
                f"got {timeout}")):
            tfreduce.allreduce_grads_collective(grads, GPU_DEVICES[:2], timeout=timeout)


def test_merge_grad_list_mismatch():
    with pytest.raises(ValueError, match="tower 1 has 2 gradients and 1 variables"):
        tfreduce.merge_grad_list([[1], [1, 2]], [["a"], ["b"]])
    with pytest.raises(TypeError, match=r"tower 0, entry 1: expected a \(gradient, variable\) "
                                        r"pair, got int"):
        tfreduce.split_grad_list([[(1, "a"), 3]])


def test_collective_fetching_part_of_a_group_times_out(graph):
    # In a v1 Session fetching only tower 0's output runs only its half of
    # the group: the runtime gives up after the timeout instead of hanging.
    # (A tf.function runs every stateful op, so the whole group always runs.)
    from helpers import v1_session_config
    devices = CPU_DEVICES[:2]
    grads = grads_on(devices, [(2,)])
    out = tfreduce.allreduce_grads_collective(grads, devices, timeout=1.0)
    with tf.compat.v1.Session(graph=graph, config=v1_session_config()) as sess:
        with pytest.raises(tf.errors.DeadlineExceededError,
                           match="Collective has timed out waiting for other workers"):
            sess.run(out[0][0])
