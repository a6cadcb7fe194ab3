"""Wire compression (compression="fp16" / "bf16"): 16 bits cross devices, results back in
the gradients' dtype, against NumPy."""

import numpy as np
import pytest
import tensorflow as tf

import tfreduce
from helpers import CPU_DEVICES, GPU_DEVICES, placeholders

CPU_ALGORITHMS = ["flat", "hierarchical", "ring", "collective"]
# Unit roundoff of each wire dtype: a value rounds to within u of itself, relatively.
UNIT = {"fp16": 2.0**-11, "bf16": 2.0**-8}


def reduce_eagerly(arrays, algorithm, average, compression, **options):
    devices = CPU_DEVICES[:len(arrays)]
    grads = []
    for d, row in zip(devices, arrays):
        with tf.device(d):
            grads.append([tf.constant(a) for a in row])
    return tfreduce.allreduce_grads(grads, devices, average=average, algorithm=algorithm,
                                    compression=compression, **options)


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
@pytest.mark.parametrize("num_towers", [2, 3, 8])
@pytest.mark.parametrize("algorithm", CPU_ALGORITHMS)
def test_values_within_the_bound_of_16_bit_rounding(algorithm, num_towers, compression):
    rng = np.random.default_rng(num_towers)
    arrays = [[rng.normal(size=(4, 5)).astype(np.float32), rng.normal(size=(3,))]
              for _ in range(num_towers)]  # float32 and float64 gradients
    for average in (False, True):
        out = reduce_eagerly(arrays, algorithm, average, compression, pack_bytes=None)
        scale = 1.0 / num_towers if average else 1.0
        u = UNIT[compression]
        for n in range(2):
            column = np.array([row[n] for row in arrays], np.float64)
            want = column.sum(axis=0) * scale
            magnitude = np.abs(column).sum(axis=0) * scale
            # Each input rounds once to 16 bits and the result once more.
            # Flat sums in float32; hierarchical too, its group sums rounding
            # once more before they cross; the ring's partial sums and the
            # collective's sum round at every hop.
            bound = {"flat": u * magnitude + u * np.abs(want),
                     "ring": (num_towers + 1) * u * magnitude,
                     "hierarchical": 2 * u * magnitude + u * np.abs(want),
                     "collective": (num_towers + 1) * u * magnitude}[algorithm] + 1e-6
            for k in range(num_towers):
                got = out[k][n]
                assert got.dtype == arrays[0][n].dtype
                assert got.device.endswith(CPU_DEVICES[k][len("/device"):])
                error = np.abs(got.numpy() - want)
                assert np.all(error <= bound), (n, k, error.max(), bound.max())


@pytest.mark.parametrize("algorithm", CPU_ALGORITHMS)
def test_a_mean_of_values_near_the_float16_limit_does_not_overflow(algorithm):
    # 60000 on each of 8 towers: the float16 sum would be inf (max 65504);
    # the mean is 60000. Sums are formed in float32, or prescaled by 1/8.
    arrays = [[np.full((6,), 60000.0, np.float32), np.full((2,), 60000.0, np.float16)]
              for _ in range(8)]
    out = reduce_eagerly(arrays, algorithm, True, "fp16")
    for row in out:
        assert np.all(np.isfinite(row[0].numpy())) and np.all(np.isfinite(row[1].numpy()))
        np.testing.assert_allclose(row[0].numpy(), 60000.0, rtol=2**-10)
        np.testing.assert_allclose(row[1].numpy().astype(np.float32), 60000.0, rtol=2**-10)


def test_integer_and_16_bit_gradients_are_left_as_they_are():
    arrays = [[np.arange(4, dtype=np.int32) * (k + 1), np.full((3,), 0.5, tf.bfloat16.as_numpy_dtype)]
              for k in range(3)]
    out = reduce_eagerly(arrays, "flat", False, "fp16")
    for row in out:
        assert row[0].dtype == tf.int32 and row[0].numpy().tolist() == [0, 6, 12, 18]
        assert row[1].dtype == tf.bfloat16 and row[1].numpy().astype(float).tolist() == [1.5] * 3


def test_indexed_slices_cross_in_16_bits_and_come_back_in_their_dtype():
    devices = CPU_DEVICES[:2]
    grads = []
    for k, d in enumerate(devices):
        with tf.device(d):
            grads.append([tf.IndexedSlices(tf.constant([[1.0, 2.0]]) * (k + 1),
                                           tf.constant([k]), tf.constant([3, 2]))])
    out = tfreduce.allreduce_grads(grads, devices, algorithm="flat", compression="bf16")
    for row in out:
        assert isinstance(row[0], tf.IndexedSlices) and row[0].values.dtype == tf.float32
        np.testing.assert_array_equal(tf.convert_to_tensor(row[0]).numpy(),
                                      [[1.0, 2.0], [2.0, 4.0], [0.0, 0.0]])


@pytest.mark.parametrize("algorithm", ["flat", "hierarchical", "ring"])
def test_traffic_analysis_shows_half_the_bytes(algorithm):
    def sent(compression):
        with tf.Graph().as_default():
            grads = placeholders(GPU_DEVICES[:4], [(256,), (64, 8)])
            out = tfreduce.allreduce_grads(grads, GPU_DEVICES[:4], average=True,
                                           algorithm=algorithm, compression=compression)
            return tfreduce.analyze_traffic(out, inputs=grads).total_bytes

    assert sent("fp16") * 2 == sent(None)
    assert sent("bf16") * 2 == sent(None)


def test_bad_compression_values():
    with pytest.raises(ValueError, match=r"compression must be None, 'fp16' or 'bf16', got 'int8'"):
        reduce_eagerly([[np.ones(2, np.float32)]] * 2, "flat", False, "int8")
    with tf.Graph().as_default():
        grads = placeholders(GPU_DEVICES[:2], [(4,)])
        with pytest.raises(TypeError, match=r"algorithm 'nccl' cannot reduce bfloat16 gradients"):
            tfreduce.allreduce_grads(grads, GPU_DEVICES[:2], algorithm="nccl", compression="bf16")
    with pytest.raises(ValueError, match=r"compression must be None, 'fp16' or 'bf16', got 16"):
        tfreduce.CrossDeviceOps("flat", compression=16)


@pytest.mark.slow
def test_replicated_trainer_trains_with_compression():
    import keras

    def model():
        keras.utils.set_random_seed(3)
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 5)).astype(np.float32), rng.integers(0, 3, 64)
    weights = {}
    for compression in (None, "fp16", "bf16"):
        trainer = tfreduce.ReplicatedTrainer(
            model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            lambda: keras.optimizers.SGD(0.1), devices=CPU_DEVICES[:4], algorithm="ring",
            compression=compression)
        trainer.fit(x, y, epochs=2, batch_size=16, verbose=0)
        assert trainer.check_replicas() == 0.0  # every tower applies the same update
        weights[compression] = trainer.models[0].get_weights()[0]
    # 8 SGD steps of gradients rounded to 16 bits stay close to the float32 run.
    np.testing.assert_allclose(weights["fp16"], weights[None], atol=2e-3)
    np.testing.assert_allclose(weights["bf16"], weights[None], atol=2e-2)
    assert not np.array_equal(weights["bf16"], weights[None])  # it did compress
    with pytest.raises(ValueError, match=r"compression must be None, 'fp16' or 'bf16', got 'fp8'"):
        tfreduce.ReplicatedTrainer(model, "mse", lambda: keras.optimizers.SGD(0.1),
                                   devices=CPU_DEVICES[:2], compression="fp8")


def test_the_multi_worker_reduction_takes_compression_itself():
    from tfreduce.doors.multiworker import check_local_options

    with pytest.raises(ValueError, match=r"^local_options compression='fp16': pass compression= "
                                         r"to allreduce_grads_multiworker itself, which "
                                         r"compresses the cross-worker step"):
        check_local_options({"compression": "fp16"})
    assert check_local_options({"compression": None, "groups": [[0, 1]]}) == {
        "compression": None, "groups": [[0, 1]]}


# ------------------------------------------------------------------ the one type

def test_the_named_compressors_and_their_aliases():
    from tfreduce.buffers.compression import as_compressor

    C = tfreduce.Compression
    assert [as_compressor(a) for a in (None, "none", "fp16", "bf16")] == [C.none, C.none,
                                                                          C.fp16, C.bf16]
    assert as_compressor(C.bf16) is C.bf16
    assert [c.name for c in (C.none, C.fp16, C.bf16)] == ["none", "fp16", "bf16"]
    assert repr(C.fp16) == "tfreduce.Compression.fp16"
    assert (C.none.compresses, C.fp16.compresses) == (False, True)
    assert C.fp16.wire_dtype(tf.float64) == tf.float16
    assert C.bf16.wire_dtype(tf.float32) == tf.bfloat16
    for dtype in (tf.float16, tf.bfloat16, tf.int32):
        assert C.fp16.wire_dtype(dtype) == dtype and C.bf16.wire_dtype(dtype) == dtype
    with pytest.raises(ValueError, match=r"PowerSGD keeps state between steps: it is a "
                                         r"ReplicatedTrainer option of its own, "
                                         r"powersgd=tfreduce.PowerSGD\(rank=2\)"):
        as_compressor(tfreduce.PowerSGD(rank=2))


def test_compress_and_decompress_on_the_current_device():
    C = tfreduce.Compression
    with tf.device(CPU_DEVICES[1]):
        x = tf.constant([1.0, 2.5, 65519.0], tf.float64)
        wire, ctx = C.fp16.compress(x)
        back = C.fp16.decompress(wire, ctx)
        same, none_ctx = C.fp16.compress(tf.constant([3], tf.int64))
        slices, slices_ctx = C.bf16.compress(tf.IndexedSlices(tf.constant([[1.5, 3.0]]),
                                                              tf.constant([2])))
    assert wire.dtype == tf.float16 and ctx == tf.float64 and wire.device.endswith("CPU:1")
    assert back.dtype == tf.float64 and back.numpy().tolist() == [1.0, 2.5, 65504.0]
    assert none_ctx is None and same.dtype == tf.int64
    assert isinstance(slices, tf.IndexedSlices) and slices.values.dtype == tf.bfloat16
    assert slices_ctx == tf.float32 and slices.indices.numpy().tolist() == [2]
    assert C.none.compress(x) == (x, None) and C.none.decompress(x, None) is x


@pytest.mark.parametrize("algorithm", CPU_ALGORITHMS)
def test_a_compressor_and_its_alias_build_the_same_reduction(algorithm):
    rng = np.random.default_rng(5)
    arrays = [[rng.normal(size=(4, 5)).astype(np.float32)] for _ in range(3)]
    by_alias = reduce_eagerly(arrays, algorithm, True, "bf16")
    by_type = reduce_eagerly(arrays, algorithm, True, tfreduce.Compression.bf16)
    for a, b in zip(by_alias, by_type):
        np.testing.assert_array_equal(a[0].numpy(), b[0].numpy())


@pytest.mark.parametrize("algorithm", CPU_ALGORITHMS)
def test_a_mean_that_fits_never_overflows_whatever_one_tower_holds(algorithm):
    # Property over magnitudes up to 65504 * K: one tower far beyond float16's
    # range, the mean within it. Each tower scales by 1/K before the cast.
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=12, deadline=None, derandomize=True, database=None)
    @given(num_towers=st.sampled_from([2, 3, 8]), data=st.data())
    def prop(num_towers, data):
        limit = 65504.0 * num_towers
        big = data.draw(st.floats(-limit, limit, width=32))
        rest = data.draw(st.lists(st.floats(-60000.0, 60000.0, width=32),
                                  min_size=num_towers - 1, max_size=num_towers - 1))
        column = np.array([big] + rest, np.float64)
        mean = column.mean()
        if abs(mean) > 60000.0:
            return  # the mean itself does not fit
        arrays = [[np.full((3,), value, np.float32)] for value in column]
        out = reduce_eagerly(arrays, algorithm, True, "fp16", pack_bytes=None)
        # Every input and partial sum rounds to float16: (K + 1) roundings
        # of at most the largest magnitude / K.
        bound = (num_towers + 2) * UNIT["fp16"] * np.abs(column).sum() / num_towers + 1e-3
        for row in out:
            got = row[0].numpy()
            assert np.all(np.isfinite(got)), (column, got)
            assert np.all(np.abs(got - mean) <= bound), (column, got, mean, bound)

    prop()


def test_a_sum_that_does_not_fit_is_inf():
    # Without averaging nothing is scaled: a float16 sum above 65504 is inf,
    # as Horovod's; the trainer's non-finite guard names it.
    arrays = [[np.full((2,), 40000.0, np.float32)] for _ in range(2)]
    for algorithm in CPU_ALGORITHMS:
        out = reduce_eagerly(arrays, algorithm, False, "fp16")
        assert np.all(np.isinf(out[1][0].numpy())), algorithm
