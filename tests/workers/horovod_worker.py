"""A Horovod-style script on tfreduce.tensorflow: one process per device, for tests/test_horovod.py.

Run under ``tfreduce-launch --workers 2`` (TF_CONFIG set), every rank:

1. checks the process functions and the collectives (allreduce, grouped,
   allgather of uneven rows, broadcast from rank 1, broadcast_variables);
2. fits a Dense model with Adam for 3 epochs through ``model.fit`` and
   ``DistributedOptimizer``, feeding its half of every global batch of 32,
   from weights drawn with a seed of its own (the broadcast callback makes
   them equal), with ``MetricAverageCallback``; once plain, once with
   ``Compression.fp16``, once with ``backward_passes_per_step=4`` (each
   micro-batch a quarter of the global batch), and with a
   ``SyncBatchNormalization`` layer in float32 and in float64;
3. trains the same model in a custom loop with ``DistributedGradientTape``.

It writes ``rank<r>.npz`` into --out. ``reference`` (no TF_CONFIG needed)
computes what one process does on the whole global batches.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))
from helpers import thread_count  # noqa: E402

GLOBAL_BATCH, EPOCHS, EXAMPLES = 32, 3, 96
FIT_SEED, TAPE_SEED = 100, 200  # rank r draws its first weights from seed + r


def data(dtype="float32"):
    """96 examples of 6 features, 3 classes."""
    rng = np.random.default_rng(0)
    return rng.normal(size=(EXAMPLES, 6)).astype(dtype), rng.integers(0, 3, EXAMPLES)


def part(array, rank, size):
    """This rank's part of every global batch, in order."""
    rows = [np.arange(start + rank * GLOBAL_BATCH // size, start + (rank + 1) * GLOBAL_BATCH // size)
            for start in range(0, len(array), GLOBAL_BATCH)]
    return array[np.concatenate(rows)]


def make_model(seed, dtype="float32", norm=None, hidden=8):
    """Dense, [a BatchNorm layer of class norm,] Dense, weights drawn from seed."""
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((6,), dtype=dtype), keras.layers.Dense(hidden, activation="relu",
                                                                dtype=dtype)]
    if norm is not None:
        layers.append(norm(momentum=0.5, dtype=dtype))
    return keras.Sequential(layers + [keras.layers.Dense(3, dtype=dtype)])


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def reference(micro=1, dtype="float32", batch_norm=False, mixed=False):
    """One process fitting the whole global batches from rank 0's weights (micro: accumulated).

    mixed: under Keras' mixed_float16 policy (float32 again after)."""
    if mixed:
        keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        return _reference(micro, dtype, batch_norm)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _reference(micro, dtype, batch_norm):
    model = make_model(FIT_SEED, dtype, keras.layers.BatchNormalization if batch_norm else None)
    optimizer = keras.optimizers.Adam(0.01, gradient_accumulation_steps=micro if micro > 1
                                      else None)
    model.compile(optimizer=optimizer, loss=loss_fn())
    x, y = data(dtype)
    history = model.fit(x, y, batch_size=GLOBAL_BATCH // micro, epochs=EPOCHS, shuffle=False,
                        verbose=0)
    return [v.numpy() for v in model.variables], history.history["loss"]


def reference_tape():
    """One process, the custom loop on whole global batches from rank 0's weights."""
    model, optimizer, (x, y) = make_model(TAPE_SEED), keras.optimizers.SGD(0.1), data()
    for _ in range(EPOCHS):
        for start in range(0, EXAMPLES, GLOBAL_BATCH):
            with tf.GradientTape() as tape:
                loss = loss_fn()(y[start:start + GLOBAL_BATCH],
                                 model(x[start:start + GLOBAL_BATCH]))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return [v.numpy() for v in model.variables]


def collectives(hvd, out):
    r, n = hvd.rank(), hvd.size()
    out["process"] = np.array([r, n, hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
                               hvd.cross_size()])
    x = tf.constant([1.0, 2.0]) * (r + 1)
    out["mean"] = hvd.allreduce(x).numpy()
    out["sum"] = hvd.allreduce(x, op=hvd.Sum).numpy()
    out["scaled"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0,
                                  postscale_factor=0.5).numpy()
    out["fp16"] = hvd.allreduce(tf.constant([[70000.0, 1.0], [10000.0, 3.0]][r]),
                                compression=hvd.Compression.fp16).numpy()
    grouped = hvd.grouped_allreduce([x, tf.constant([[r]], tf.int64)], op=hvd.Sum)
    out["grouped0"], out["grouped1"] = grouped[0].numpy(), grouped[1].numpy()
    out["gather"] = hvd.allgather(tf.fill([r + 1, 2], r)).numpy()
    rows = tf.constant([[1.0], [2.0], [3.0]]) + 2 * r
    out["scatter"] = hvd.reducescatter(rows).numpy()
    out["scatter_fp16"] = hvd.grouped_reducescatter(
        [tf.constant([[1000.5], [3.0], [7.0]]) * (r + 1)], compression=hvd.Compression.fp16,
        op=hvd.Sum, postscale_factor=0.5)[0].numpy()
    splits = [[1, 2], [0, 1]][r]
    exchanged, received = hvd.alltoall(tf.constant([[10.0], [20.0], [30.0]][:sum(splits)]) + r,
                                       splits=splits)
    out["alltoall"], out["received"] = exchanged.numpy(), received.numpy()
    # Rank 0 repeats its splits, rank 1 changes its own: the pattern is new
    # to both, so neither may reuse the first call's function (and keys).
    splits = [[1, 2], [1, 0]][r]
    out["alltoall_again"] = hvd.alltoall(tf.constant([[10.0], [20.0], [30.0]][:sum(splits)])
                                         + r, splits=splits)[0].numpy()
    out["alltoall_even"] = hvd.alltoall(tf.range(2 + 2 * r) + 10 * r).numpy()
    try:  # 3 rows cannot be shared evenly by 2 processes
        hvd.alltoall(tf.range(3 + r))
    except tf.errors.InvalidArgumentError as e:  # Horovod's class
        out["alltoall_uneven"] = np.array(f"{type(e).__name__}: {e}")
    out["after_uneven"] = hvd.alltoall(tf.range(2) + 10 * r).numpy()
    out["bcast"] = hvd.broadcast(tf.constant([10.0, 20.0]) * (r + 1), root_rank=1).numpy()
    v = tf.Variable([float(r), 5.0 + r])
    hvd.broadcast_variables([v], root_rank=1)
    out["bcast_var"] = v.numpy()
    # Dtypes TF's broadcast lacks cross widened, beside a packed float32.
    small = [tf.Variable(tf.constant([200 + r, r], tf.uint8)),
             tf.Variable(tf.constant([-3 - r], tf.int16)), tf.Variable([r == 1]),
             tf.Variable([0.5 + r])]
    hvd.broadcast_variables(small, root_rank=1)
    for i, var in enumerate(small):
        out[f"bcast_small{i}"] = var.numpy()
    try:
        hvd.broadcast(x, root_rank=2)
    except ValueError as e:
        out["root_error"] = np.array(str(e))


def threads(hvd, out):
    """This process's threads before and after 40 eager all-reduces and 40 in a tf.function.

    TF's per-op timeout holds a sleeping thread per op execution for the whole
    timeout; Horovod's own test suite, thousands of calls, once ran out of them."""
    x = tf.ones([3])
    step = tf.function(lambda v: hvd.allreduce(v * 2.0))
    hvd.allreduce(x)
    step(x)  # both traced
    before = thread_count()
    for _ in range(40):
        hvd.allreduce(x)
        step(x)
    out["threads"] = np.array([before, thread_count()])


def semantics(hvd, out):
    """Horovod's semantics beyond floats: narrow dtypes, integer means, Min/Max/Product, objects."""
    r = hvd.rank()
    x8 = tf.constant([[100, -100, 3], [120, -120, 5]][r], tf.int8)
    out["int8_sum"] = hvd.allreduce(x8, op=hvd.Sum).numpy()
    out["int8_mean"] = hvd.allreduce(x8).numpy()
    out["uint8_mean"] = hvd.allreduce(tf.constant([[200, 1, 7], [100, 2, 8]][r], tf.uint8)).numpy()
    i32 = tf.constant([[4, 8], [6, 9]][r], tf.int32)
    out["int_prescale"] = hvd.allreduce(i32, op=hvd.Sum, prescale_factor=0.75).numpy()
    out["int_postscale"] = hvd.allreduce(i32, postscale_factor=0.5).numpy()
    f = tf.constant([[1.0, 5.0, -2.0], [3.0, 2.0, 4.0]][r])
    for op in ("Min", "Max", "Product"):
        out[f"float_{op}"] = hvd.allreduce(f, op=getattr(hvd, op)).numpy()
    out["int16_Max"] = hvd.allreduce(tf.constant([[1, -5], [3, -7]][r], tf.int16),
                                     op=hvd.Max).numpy()
    # An embedding's gradient in a custom loop: IndexedSlices without dense_shape.
    slices = hvd.allreduce(tf.IndexedSlices(tf.constant([[1.0, 2.0]]) * (r + 1),
                                            tf.constant([r])), op=hvd.Sum)
    out["slices"] = slices.values.numpy()
    out["slices_rows"] = slices.indices.numpy()
    out["slices_shape"] = np.array(slices.dense_shape is None)
    rows8 = tf.IndexedSlices(tf.constant([[100, 7]], tf.uint8) * (r + 1), tf.constant([r]))
    out["slices_uint8_sum"] = hvd.allreduce(rows8, op=hvd.Sum).values.numpy()
    out["slices_uint8_mean"] = hvd.allreduce(rows8).values.numpy()
    out["slices_int64_mean"] = hvd.allreduce(
        tf.IndexedSlices(tf.constant([[3, -5]], tf.int64), tf.constant([r]))).values.numpy()
    try:
        hvd.allreduce(tf.IndexedSlices(f[None], tf.constant([0])), op=hvd.Min)
    except NotImplementedError as e:
        out["slices_min_error"] = np.array(str(e))
    out["gather_bool"] = hvd.allgather(tf.constant([[True], [False]][r])).numpy()
    out["gather_int8"] = hvd.allgather(tf.constant([[-3], [4]][r], tf.int8)).numpy()
    out["gather_bfloat16"] = tf.cast(hvd.allgather(tf.constant([[1.5], [2.5]][r], tf.bfloat16)),
                                     tf.float32).numpy()
    out["bcast_int16"] = hvd.broadcast(tf.constant([[-3, 9], [4, 1]][r], tf.int16), 1).numpy()
    out["objects"] = np.array(repr(hvd.allgather_object({"rank": r, "s": "x" * (r + 3)})))
    out["object"] = np.array(repr(hvd.broadcast_object({"rank": r, "l": list(range(r + 2))},
                                                       root_rank=1)))
    out["rank_ops"] = np.array([int(hvd.rank_op()), int(hvd.size_op()), int(hvd.local_rank_op()),
                                int(hvd.local_size_op())])
    v = tf.Variable([float(r)])
    out["broadcast_"] = hvd.broadcast_([v], 1)[0].numpy()
    out["scatter_int_mean"] = hvd.reducescatter(tf.constant([[3], [5], [7]]) * (r + 1)).numpy()
    out["alltoall_int8"] = hvd.alltoall(tf.constant([1, 2], tf.int8) + r).numpy()


def gradients(hvd, out):
    """The gradient through each collective, Horovod's rule; allgathers of changing row counts."""
    r = hvd.rank()
    x = tf.Variable([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    calls = {"allreduce": lambda: hvd.allreduce(x), "sum": lambda: hvd.allreduce(x, op=hvd.Sum),
             "grouped": lambda: hvd.grouped_allreduce([x, 2 * x])[1],
             "allgather": lambda: hvd.allgather(x[:2 - r]), "broadcast": lambda: hvd.broadcast(x, 1),
             "reducescatter": lambda: hvd.reducescatter(x),
             "alltoall": lambda: hvd.alltoall(x, splits=[[1, 2], [3, 0]][r])[0]}
    for name, call in calls.items():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(call() * (r + 1))  # upstream gradient r + 1
        out[f"grad_{name}"] = tape.gradient(loss, x).numpy()
    # TF's runtime keeps the shape an instance first ran with: 1 and 2 rows
    # (padded to 2), then 3 rows each.
    out["gathered_again"] = hvd.allgather(x).numpy()


def local_layers(hvd, hvdk, out):
    """Horovod's partial wrappers: a local first layer, trained on each rank's own batches."""
    r = hvd.rank()
    x, y = (part(a, r, hvd.size()) for a in data())
    model = make_model(TAPE_SEED)  # the same first weights on every rank
    optimizer = keras.optimizers.SGD(0.1)
    for start in range(0, len(x), GLOBAL_BATCH // 2):
        xb, yb = x[start:start + GLOBAL_BATCH // 2], y[start:start + GLOBAL_BATCH // 2]
        with tf.GradientTape(persistent=True) as tape:
            loss = loss_fn()(yb, model(xb))
        own = tape.gradient(loss, model.trainable_variables)
        partial = hvd.PartialDistributedGradientTape(tape, local_layers=[model.layers[0]])
        local, reduced = partial.get_local_and_global_gradients(loss, model.trainable_variables)
        # A local gradient is this rank's own, divided by the 2 processes.
        out["local_grad_error"] = max(float(np.max(np.abs(g.numpy() - o.numpy() / 2)))
                                      for (_, g), o in zip(local, own[:2]))
        optimizer.apply_gradients([(g, v) for v, g in local + reduced])  # (source, grad) pairs
    for i, v in enumerate(model.trainable_variables):
        out[f"partial_tape/{i}"] = v.numpy()
    model = make_model(FIT_SEED)
    model.compile(loss=loss_fn(), optimizer=hvdk.PartialDistributedOptimizer(
        keras.optimizers.Adam(0.01), local_layers=model.layers[0]))
    model.fit(x, y, batch_size=GLOBAL_BATCH // 2, epochs=1, shuffle=False, verbose=0)
    for i, v in enumerate(model.trainable_variables):
        out[f"partial_fit/{i}"] = v.numpy()


def mismatches(hvd, out):
    """Calls that differ between the ranks: an error on each, and the next call works."""
    r = hvd.rank()
    calls = {"shape": lambda: hvd.allreduce(tf.ones([3 + r])),
             "names": lambda: hvd.allreduce(tf.ones([2]), name=["a", "b"][r]),
             "root": lambda: hvd.broadcast(tf.ones([2]), r),
             "kind": lambda: (hvd.allreduce if r == 0 else hvd.allgather)(tf.ones([2]))}
    for name, call in calls.items():
        try:
            call()
            out[f"mismatch_{name}"] = np.array("")
        except tf.errors.FailedPreconditionError as e:  # Horovod's class for a mismatch
            out[f"mismatch_{name}"] = np.array(f"{type(e).__name__}: {e}")
        out[f"after_{name}"] = hvd.allreduce(tf.ones([2]) * r, op=hvd.Sum).numpy()
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:  # TF1 graph mode
        try:
            session.run(hvd.allreduce(tf.ones([3 + r])))
        except tf.errors.InvalidArgumentError as e:  # TF's py_function maps a ValueError so
            out["v1_graph_error"] = np.array(e.message)
        out["v1_graph_next"] = session.run(hvd.allreduce(tf.ones([2]) * r, op=hvd.Sum))
    out["after_v1_graph"] = hvd.allreduce(tf.ones([2]) * r, op=hvd.Sum).numpy()


def uneven(hvd, out):
    """Ranks with 3 and 2 batches: join() lets rank 0 finish, then a call join() refuses."""
    r = hvd.rank()
    w = tf.Variable([1.0, 1.0])
    for step in range([3, 2][r]):
        out[f"join/sum{step}"] = hvd.allreduce(tf.constant([1.0 + step, 10.0 * r]),
                                               op=hvd.Sum).numpy()
        out[f"join/int_mean{step}"] = hvd.allreduce(tf.constant([5 + step, r], tf.int32)).numpy()
        with tf.GradientTape() as tape:  # Horovod's custom loop, eagerly
            loss = tf.reduce_sum(w * tf.constant([2.0 + step, 4.0 * r]))
        out[f"join/grad{step}"] = hvd.DistributedGradientTape(tape).gradient(loss, [w])[0].numpy()
    out["join/last"] = hvd.join().numpy()
    if r == 1:  # now rank 0 joins first
        out["join/sum_again"] = hvd.allreduce(tf.constant([7.0]), op=hvd.Sum).numpy()
    out["join/last_again"] = hvd.join().numpy()
    try:  # only dense Sum and Average all-reduces go on while a rank waits in join()
        out["join/refused"] = (hvd.join() if r == 1 else hvd.allgather(tf.ones([2]))).numpy()
    except tf.errors.FailedPreconditionError as e:
        out["join/refused"] = np.array(f"{type(e).__name__}: {e}")
    out["join/after"] = hvd.allreduce(tf.ones([2]) * r, op=hvd.Sum).numpy()


def session_graph(hvd, out):
    """Horovod's TF1 graph mode: the collectives built in a tf.compat.v1 graph, run by a
    session of each process's own."""
    r = hvd.rank()
    with tf.Graph().as_default():
        x = tf.constant([[1.0 + r, 2.0]])
        ops = {"allreduce": hvd.allreduce(tf.constant([1.0 + r, 2.0]), op=hvd.Sum),
               "allreduce_uint8": hvd.allreduce(tf.constant([3, 5 + r], tf.uint8)),
               "allgather": hvd.allgather(tf.constant([[r]] * (r + 1))),
               "broadcast": hvd.broadcast(tf.constant([1.0 + r, 5.0]), 1),
               "reducescatter": hvd.reducescatter(tf.constant([[1.0], [2.0], [3.0]]) + r)}
        splits = [[1, 2], [0, 1]][r]
        rows = tf.constant([[10.0], [20.0], [30.0]][:sum(splits)]) + r
        ops["alltoall"], ops["alltoall_received"] = hvd.alltoall(rows, splits=splits)
        ops["grad_allgather"] = tf.gradients(tf.reduce_sum(hvd.allgather(x) ** 2), x)[0]
        ops["grad_alltoall"] = tf.gradients(tf.reduce_sum(ops["alltoall"] * 3.0), rows)[0]
        # Rank 1's zeros wait for its all-reduce, which the root's needs.
        ops["grad_broadcast"] = tf.gradients(tf.reduce_sum(hvd.broadcast(x, 0) * 2.0), x)[0]
        # Evenly split, rows come back unevenly: rank 0 sends 1 + 1, gets 1 + 2.
        even = tf.constant([[1.0], [2.0], [3.0], [4.0]][:2 + 2 * r])
        ops["grad_alltoall_even"] = tf.gradients(tf.reduce_sum(hvd.alltoall(even) * 3.0),
                                                 even)[0]
        v = tf.compat.v1.Variable([float(r), 3.0 + r])
        w = tf.compat.v1.Variable([float(r)], use_resource=False)  # a reference variable
        assign = hvd.broadcast_variables([v], 1)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            for name, op in ops.items():
                out[f"v1/{name}"] = session.run(op)
            session.run(assign)
            out["v1/variable"] = session.run(v)
            session.run(hvd.broadcast_global_variables(0))
            out["v1/allgather_object"] = np.array(repr(hvd.allgather_object({"rank": r}, session)))
            with session.as_default():  # Horovod's default: the default session
                out["v1/broadcast_object"] = np.array(repr(hvd.broadcast_object(("r", r), 1)))
            out["v1/global_v"], out["v1/global_w"] = session.run([v, w])
            # Two calls alike that one run may make in either order: never
            # paired across the two ops (right sums, or an error on both).
            pair = [hvd.allreduce(tf.constant([1.0]) * (r + 1), op=hvd.Sum),
                    hvd.allreduce(tf.constant([10.0]) * (r + 1), op=hvd.Sum)]
            try:
                out["v1/side_by_side"] = np.array(str(session.run(pair)))
            except tf.errors.InvalidArgumentError as e:
                out["v1/side_by_side"] = np.array(e.message)


def fit(hvdk, out, name, micro=1, dtype="float32", norm=None, hidden=8, **options):
    r = hvdk.rank()
    model = make_model(FIT_SEED + r, dtype, norm, hidden)  # other weights on every rank
    optimizer = hvdk.DistributedOptimizer(keras.optimizers.Adam(0.01), **options)
    model.compile(optimizer=optimizer, loss=loss_fn())
    if dtype == "float64":
        # Arrays: Keras feeds a PyDataset's float64 batches through float32.
        x, y = (part(a, r, hvdk.size()) for a in data(dtype))
        feed = {"x": x, "y": y, "batch_size": GLOBAL_BATCH // hvdk.size(), "shuffle": False}
    else:
        # Unshuffled, to follow the reference's batches.
        feed = {"x": hvdk.DistributedBatches(*data(dtype), GLOBAL_BATCH // micro, shuffle=False)}
    history = model.fit(**feed, epochs=EPOCHS, verbose=0,
                        callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0),
                                   hvdk.callbacks.MetricAverageCallback()])
    for i, v in enumerate(model.variables):
        out[f"{name}/{i}"] = v.numpy()
    out[f"{name}/loss"] = np.array(history.history["loss"])
    out[f"{name}/class"] = np.array(type(model.optimizer).__name__)
    if name == "mixed":
        out[f"{name}/optimizer"] = model.optimizer


def custom_loop(hvd, out):
    r, n = hvd.rank(), hvd.size()
    model, optimizer = make_model(seed=TAPE_SEED + r), keras.optimizers.SGD(0.1)
    hvd.broadcast_variables(model.variables, root_rank=0)
    x, y = (part(a, r, n) for a in data())
    half = GLOBAL_BATCH // n

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn()(yb, model(xb))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for _ in range(EPOCHS):
        for start in range(0, len(x), half):
            step(x[start:start + half], y[start:start + half])
    for i, v in enumerate(model.variables):
        out[f"tape/{i}"] = v.numpy()


def resumable(hvdk, folder, kill_at):
    """5 epochs of shuffled DistributedBatches, resumable: BackupAndRestore and
    ModelCheckpoint on rank 0 only; rank 0 dies after epoch kill_at's backups
    unless the launcher restarted the run. Returns rank's final weights."""
    r = hvdk.rank()
    model = make_model(FIT_SEED + r)
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  loss=loss_fn())

    class Die(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == kill_at:
                os._exit(3)

    callbacks = [hvdk.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvdk.callbacks.MetricAverageCallback()]
    if r == 0:
        callbacks.insert(0, keras.callbacks.BackupAndRestore(os.path.join(folder, "backup")))
        callbacks.append(keras.callbacks.ModelCheckpoint(
            os.path.join(folder, "epoch{epoch}.weights.h5"), save_weights_only=True))
        if kill_at is not None and os.environ.get("TFREDUCE_RESTART_COUNT", "0") == "0":
            callbacks.append(Die())
    history = model.fit(hvdk.DistributedBatches(*data(), GLOBAL_BATCH, seed=5), epochs=5,
                        verbose=0, callbacks=callbacks)
    out = {f"weights/{i}": v.numpy() for i, v in enumerate(model.variables)}
    out["epochs"] = np.array(history.epoch)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rank1-hidden", type=int, default=None,
                        help="only fit, rank 1 with another hidden layer size (a mistake)")
    parser.add_argument("--resumable", action="store_true",
                        help="only the resumable run (its backups in --out)")
    parser.add_argument("--kill-at-epoch", type=int, default=None,
                        help="--resumable: rank 0 dies after this epoch, once")
    args = parser.parse_args(argv)
    import tfreduce.tensorflow as hvd
    import tfreduce.tensorflow.keras as hvdk

    if args.rank1_hidden:
        hvd.init()
        fit(hvdk, {}, "fit", hidden=args.rank1_hidden if hvd.rank() == 1 else 8)
        return 0
    if args.resumable:
        hvd.init()
        out = resumable(hvdk, args.out, args.kill_at_epoch)
        np.savez(os.path.join(args.out, f"rank{hvd.rank()}.npz"), **out)
        hvd.shutdown()
        return 0

    with_init_error = None
    try:
        hvd.rank()
    except RuntimeError as e:
        with_init_error = str(e)
    hvd.init()
    out = {"init_error": np.array(with_init_error)}
    collectives(hvd, out)
    threads(hvd, out)
    semantics(hvd, out)
    gradients(hvd, out)
    mismatches(hvd, out)
    uneven(hvd, out)
    session_graph(hvd, out)
    local_layers(hvd, hvdk, out)
    fit(hvdk, out, "fit")
    fit(hvdk, out, "fp16", compression=hvd.Compression.fp16)
    fit(hvdk, out, "passes4", micro=4, backward_passes_per_step=4,
        average_aggregated_gradients=True)
    fit(hvdk, out, "syncbn", norm=hvdk.SyncBatchNormalization)
    keras.mixed_precision.set_global_policy("mixed_float16")
    fit(hvdk, out, "mixed")
    out["mixed/scale"] = np.array(float(keras.ops.convert_to_numpy(
        out.pop("mixed/optimizer").dynamic_scale)))
    keras.mixed_precision.set_global_policy("float32")
    fit(hvdk, out, "float64", dtype="float64", norm=hvdk.SyncBatchNormalization)
    custom_loop(hvd, out)
    np.savez(os.path.join(args.out, f"rank{hvd.rank()}.npz"), **out)
    hvd.shutdown()
    print(f"rank {out['process'][0]}: done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
