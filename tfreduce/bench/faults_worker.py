"""One worker of the faults mode: a Horovod-style loop, in which rank 1 acts at a step.

The loop is what Horovod's TF2 users write and nothing more: ``import
tfreduce.tensorflow as hvd``, a small Dense model, ``DistributedGradientTape``
in a ``tf.function`` that broadcasts the variables on its first step
(``--loop tape``, Horovod's tensorflow2_mnist.py), the same tape eagerly
(``--loop eager``), or Keras ``fit`` with ``DistributedOptimizer`` and no
callback (``--loop fit``); no other tfreduce call (no ``progress.timed``).
Rank 1, at step ``--at``, does ``--case``:

- freeze: stops itself (SIGSTOP);
- lag: sleeps ``--lag-ms`` before each step from then on;
- vanish: exits with code 0 right after ``init()`` (``--at`` unused), so
  rank 0 waits for it in its first step's collectives;
- clean: nothing.

It prints "act <case> <step> <unix time>" as it acts (the bench times from
there), "loop <seconds>" (the steps' wall time, from the second step on) and
"finished" at the end.
"""

import argparse
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _act(args, rank, step):
    if rank != 1 or step != args.at or args.case == "clean":
        return
    print(f"act {args.case} {step} {time.time():.3f}", flush=True)
    if args.case == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)


def _fit(args, rank, model, x, y, loss_fn):
    import keras
    import tensorflow as tf

    import tfreduce.tensorflow.keras as hvdk

    class Act(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            _act(args, rank, batch)
            if rank == 1 and args.case == "lag" and batch >= args.at:
                time.sleep(args.lag_ms / 1000)
            if batch == 1:
                self.start = time.monotonic()

    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss=loss_fn)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
    act = Act()
    model.fit(data, steps_per_epoch=args.steps, epochs=1, verbose=0, callbacks=[act])
    return time.monotonic() - act.start


def _tape(args, rank, model, x, y, loss_fn):
    import keras
    import tensorflow as tf

    import tfreduce.tensorflow as hvd

    optimizer = keras.optimizers.SGD(0.01)

    def step(x, y, first):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if first:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables, root_rank=0)
        return loss

    traced = tf.function(step) if args.loop == "tape" else step
    for i in range(args.steps):
        _act(args, rank, i)
        if rank == 1 and args.case == "lag" and i >= args.at:
            time.sleep(args.lag_ms / 1000)
        if i == 1:
            start = time.monotonic()
        traced(x, y, i == 0)
    return time.monotonic() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("freeze", "lag", "vanish", "clean"), required=True)
    parser.add_argument("--loop", choices=("tape", "eager", "fit"), default="tape")
    parser.add_argument("--at", type=int, default=30)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lag-ms", type=float, default=50.0)
    args = parser.parse_args(argv)

    import keras
    import numpy as np

    import tfreduce.tensorflow as hvd

    hvd.init()
    rank = hvd.rank()
    if args.case == "vanish" and rank == 1:
        print(f"act vanish 0 {time.time():.3f}", flush=True)
        return 0
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(4)])
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(64, 16)).astype("float32")
    y = rng.integers(0, 4, 64)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    seconds = (_fit if args.loop == "fit" else _tape)(args, rank, model, x, y, loss_fn)
    print(f"loop {seconds:.4f}", flush=True)
    print("finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
