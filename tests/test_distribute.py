"""tfreduce.CrossDeviceOps: Keras model.fit under MirroredStrategy on tfreduce's all-reduce."""

import functools
import itertools
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfreduce
import tfreduce.doors.distribute
import zygote
from helpers import CPU_DEVICES, load_script

WORKER = os.path.join(os.path.dirname(__file__), "workers", "keras_fit_worker.py")
CPU_ALGORITHMS = ["flat", "hierarchical", "ring", "collective"]
# float32 weights after 2 epochs: the sums are formed in another order than
# TF's, so they agree to float32 rounding (measured: at most 6e-8).
FLOAT32 = dict(rtol=1e-5, atol=1e-6)


worker = load_script(WORKER, "keras_fit_worker")


@pytest.fixture(scope="module")
def default_run(request, tmp_path_factory):
    """MirroredStrategy's default reduction (CollectiveAllReduce here), in its own process."""
    out = tmp_path_factory.mktemp("default") / "weights.npz"
    done = zygote.run([sys.executable, WORKER, str(request.param), str(out)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = np.load(out)
    weights = [saved[f"arr_{i}"] for i in range(len(saved.files) - 1)]
    return request.param, weights, list(saved["losses"])


# Each algorithm at one K per test, the other K in the other test: every
# (K, algorithm) pair is fitted once, every algorithm and every K in each.
FLOAT32_CASES = [(2, "flat"), (2, "hierarchical"), (4, "ring"), (4, "collective")]
FLOAT64_CASES = [(4, "flat"), (4, "hierarchical"), (2, "ring"), (2, "collective")]


def test_the_fit_cases_pair_every_k_with_every_algorithm():
    pairs = set(itertools.product((2, 4), CPU_ALGORITHMS))
    assert set(FLOAT32_CASES) | set(FLOAT64_CASES) == pairs
    for cases in (FLOAT32_CASES, FLOAT64_CASES):
        assert {k for k, _ in cases} == {2, 4} and {a for _, a in cases} == set(CPU_ALGORITHMS)


@pytest.mark.slow
@pytest.mark.parametrize("default_run, algorithm", FLOAT32_CASES, indirect=["default_run"])
def test_fit_equals_mirrored_strategys_default(default_run, algorithm):
    num_devices, want, want_losses = default_run
    got, losses = worker.fit_weights(CPU_DEVICES[:num_devices],
                                     tfreduce.CrossDeviceOps(algorithm))
    assert len(got) == len(want) == 8  # 2 kernels, 2 biases, gamma, beta, moving mean, variance
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, err_msg=f"weight {i}", **FLOAT32)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)


@functools.lru_cache(maxsize=None)
def one_device_float64():
    """fit's weights and losses in float64 on one device without a strategy (run once)."""
    return worker.fit_weights(None, dtype="float64", batch_norm=False)


@pytest.mark.slow
@pytest.mark.parametrize("num_devices, algorithm", FLOAT64_CASES)
def test_fit_in_float64_equals_one_device(num_devices, algorithm):
    # Without BatchNorm (whose statistics are per replica under the
    # strategy), K replicas on equal shards make one device's updates.
    got, losses = worker.fit_weights(CPU_DEVICES[:num_devices],
                                     tfreduce.CrossDeviceOps(algorithm), "float64", False)
    want, want_losses = one_device_float64()
    for g, w in zip(got, want):
        assert g.dtype == np.float64
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)
    # The reported loss is Keras' running mean, a float32 metric whatever the model.
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)


@pytest.mark.slow
def test_the_training_step_reduces_with_tfreduce(monkeypatch):
    # Every call of tfreduce's all-reduce is recorded while fit traces its
    # step: the gradients must go through it, not through a TF fallback.
    calls = []
    original = tfreduce.Reduction.__call__

    def spy(reduction, all_grads, devices, average=False, **kwargs):
        out = original(reduction, all_grads, devices, average, **kwargs)
        calls.append((len(all_grads), len(all_grads[0]), devices, reduction, average, out))
        return out

    monkeypatch.setattr(tfreduce.Reduction, "__call__", spy)
    worker.fit_weights(CPU_DEVICES[:4], tfreduce.CrossDeviceOps(
        "hierarchical", groups=[[0, 1], [2, 3]], pack_bytes=None), batch_norm=False)
    gradient_calls = [c for c in calls if c[1] == 4]  # two kernels, two biases
    assert gradient_calls, [c[:2] for c in calls]
    num_towers, num_vars, devices, reduction, average, out = gradient_calls[0]
    assert num_towers == 4
    assert [d.split("device:")[-1] for d in devices] == ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
    assert average is False
    assert reduction == tfreduce.Reduction("hierarchical", groups=[[0, 1], [2, 3]],
                                           pack_bytes=None)
    for k in range(4):
        for n in range(4):
            assert out[k][n].device.endswith(f"CPU:{k}")
            assert "allreduce_hierarchical" in out[k][n].name


def per_replica(strategy, fn):
    """fn(replica id) on each replica's device, as per-replica values (strategy.run)."""
    return strategy.run(lambda: fn(tf.distribute.get_replica_context().replica_id_in_sync_group))


def test_reduce_and_batch_reduce_to_against_numpy():
    strategy = tf.distribute.MirroredStrategy(
        CPU_DEVICES[:4], cross_device_ops=tfreduce.CrossDeviceOps("hierarchical"))
    rows = np.arange(4 * 3, dtype=np.float32).reshape(4, 3) ** 2
    value, other = per_replica(strategy, lambda k: (tf.gather(rows, k),
                                                    tf.cast(k + 1, tf.float32)))
    for op, reduce in ((tf.distribute.ReduceOp.SUM, np.sum), (tf.distribute.ReduceOp.MEAN,
                                                               np.mean)):
        # To the host: not an all-reduce, ReductionToOneDevice does it.
        np.testing.assert_allclose(strategy.reduce(op, value, axis=None), reduce(rows, axis=0))
        # An all-reduce onto the replicas' devices: tfreduce's.
        mirrored = strategy.extended.batch_reduce_to(op, [(value, value), (other, other)])
        for k, (a, b) in enumerate(zip(mirrored[0].values, mirrored[1].values)):
            assert a.device.endswith(f"CPU:{k}") and b.device.endswith(f"CPU:{k}")
            np.testing.assert_allclose(a.numpy(), reduce(rows, axis=0))
            assert b.numpy() == reduce([1.0, 2.0, 3.0, 4.0])
        single = strategy.extended.reduce_to(op, value, value)
        for k, v in enumerate(single.values):
            assert v.device.endswith(f"CPU:{k}")
            np.testing.assert_allclose(v.numpy(), reduce(rows, axis=0))
    copies = strategy.extended.broadcast_to(tf.constant([1.0, 2.0]), value)
    assert [v.device.split("device:")[-1] for v in copies.values] == [
        f"CPU:{k}" for k in range(4)]
    assert all(v.numpy().tolist() == [1.0, 2.0] for v in copies.values)


@pytest.mark.parametrize("algorithm", CPU_ALGORITHMS)
def test_all_gather_and_gather_go_through_tfreduce(monkeypatch, algorithm):
    calls = []
    original = tfreduce.doors.distribute.all_gather

    def spy(tensors, devices, **kwargs):
        out = original(tensors, devices, **kwargs)
        calls.append((len(tensors), kwargs["reduction"].algorithm,
                      [row[0].device.split("device:")[-1] for row in out]))
        return out

    monkeypatch.setattr(tfreduce.doors.distribute, "all_gather", spy)
    strategy = tf.distribute.MirroredStrategy(
        CPU_DEVICES[:4], cross_device_ops=tfreduce.CrossDeviceOps(algorithm,
                                                                  compression="fp16"))
    blocks = np.arange(4 * 2 * 3, dtype=np.float32).reshape(4, 2, 3)

    @tf.function
    def step():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            x = tf.gather(blocks, context.replica_id_in_sync_group)
            return context.all_gather(x, axis=1), x
        gathered, x = strategy.run(replica_fn)
        return gathered, strategy.gather(x, axis=0)

    gathered, to_host = step()
    for v in gathered.values:
        np.testing.assert_array_equal(v.numpy(), np.concatenate(list(blocks), axis=1))
    np.testing.assert_array_equal(to_host.numpy(), np.concatenate(list(blocks), axis=0))
    # Both built by tfreduce, out[k] on replica k's device (fp16 not applied).
    places = [f"CPU:{k}" for k in range(4)]
    assert calls == [(4, algorithm, places), (4, algorithm, places)]


def test_nccl_gathers_on_one_device_as_tfs_own_ops_do():
    # TF has no NCCL all-gather: CrossDeviceOps("nccl") gathers as
    # ReductionToOneDevice does (here on CPUs, where nothing else runs NCCL).
    strategy = tf.distribute.MirroredStrategy(
        CPU_DEVICES[:2], cross_device_ops=tfreduce.CrossDeviceOps("nccl"))

    @tf.function
    def step():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_gather(
            tf.fill([1, 2], tf.cast(
                tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)), 0))

    for v in step().values:
        np.testing.assert_array_equal(v.numpy(), [[0.0, 0.0], [1.0, 1.0]])


def test_bytes_per_pack_of_communication_options_is_honoured(monkeypatch):
    seen = []
    original = tfreduce.Reduction.__call__
    monkeypatch.setattr(tfreduce.Reduction, "__call__",
                        lambda reduction, *a, **kw: seen.append(reduction) or original(
                            reduction, *a, **kw))
    strategy = tf.distribute.MirroredStrategy(
        CPU_DEVICES[:2], cross_device_ops=tfreduce.CrossDeviceOps("flat"))
    value = per_replica(strategy, lambda k: tf.ones([3]))
    options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=1024)
    strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, [(value, value)], options)
    strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, [(value, value)])
    assert [reduction.pack_bytes for reduction in seen] == [1024, "auto"]


@pytest.mark.parametrize("args, kwargs, error, message", [
    (("butterfly",), {}, ValueError,
     "CrossDeviceOps: unknown all-reduce algorithm 'butterfly'; choose one of ('auto', "),
    (("hierarchical",), {"groups": [[0, 1], [1, 2]]}, ValueError,
     "device index 1 is in groups[0] and groups[1]"),
    (("hierarchical",), {"groups": [[0, 2]]}, ValueError,
     "groups [[0, 2]] leave device indices [1] out"),
    (("flat",), {"groups": [[0, 1]]}, TypeError, "algorithm 'flat' takes no option ['groups']"),
    (("auto",), {"groups": [[0, 1]]}, TypeError,
     "CrossDeviceOps: algorithm 'auto' takes no option ['groups']; it takes ['compression', "
     "'deterministic', 'pack_bytes', 'sparse_as_dense']: 'auto' picks the algorithm from the devices"),
    (("flat",), {"pack_bytes": -1}, ValueError, "pack_bytes"),
])
def test_bad_options_raise_at_construction(args, kwargs, error, message):
    with pytest.raises(error) as info:
        tfreduce.CrossDeviceOps(*args, **kwargs)
    assert message in str(info.value)


def test_groups_for_another_k_raise_at_the_first_reduction():
    strategy = tf.distribute.MirroredStrategy(
        CPU_DEVICES[:2], cross_device_ops=tfreduce.CrossDeviceOps(
            "hierarchical", groups=[[0, 1], [2, 3]]))
    value = per_replica(strategy, lambda k: tf.ones([3]))
    with pytest.raises(ValueError, match=r"groups\[1\] holds device index 2, outside 0\.\.1 "
                                         r"for 2 devices"):
        strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, [(value, value)])


def test_a_reduction_inside_an_xla_compiled_fit_is_refused_saying_what_to_do():
    import keras
    strategy = tf.distribute.MirroredStrategy(CPU_DEVICES[:2],
                                              cross_device_ops=tfreduce.CrossDeviceOps("flat"))
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=True)
    with pytest.raises(ValueError, match=r"tfreduce\.CrossDeviceOps inside an XLA-compiled step "
                                         r".*Pass jit_compile=False to compile, or train with "
                                         r"tfreduce\.ReplicatedTrainer\(jit_compile=True\)"):
        model.fit(np.ones((8, 3), np.float32), np.ones((8, 2), np.float32), batch_size=4,
                  verbose=0)


def test_values_that_share_a_device_are_reduced_on_one_device():
    # Eagerly, experimental_distribute_values_from_function leaves every
    # replica's constant on the host: no all-reduce over K devices, so
    # ReductionToOneDevice reduces them (what TF's own ops fall back to).
    strategy = tf.distribute.MirroredStrategy(
        CPU_DEVICES[:2], cross_device_ops=tfreduce.CrossDeviceOps("ring"))
    value = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(float(context.replica_id_in_sync_group + 1)))
    out = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, [(value, value)])
    assert [v.numpy() for v in strategy.experimental_local_results(out[0])] == [3.0, 3.0]
