"""One process of ``tfreduce-bench --mode train``'s Horovod-style contender, under the launcher.

Each of the P processes (``tfreduce-launch --workers P``) joins the run
(``tfreduce.tensorflow.keras.init``), builds the example's CNN with Keras'
BatchNormalization (each process's own statistics, as in Horovod), wraps
Adam in ``DistributedOptimizer`` and runs ``model.fit`` on its part of every
global batch of the train mode's random images, timed in rounds the way the
train mode times MirroredStrategy's fit (from the end of a round's first
step to the end of its last). Rank 0 writes the images per second of the
global batch, one per round, as JSON.
"""

import argparse
import json
import sys
import time

import numpy as np

from tfreduce.basis.startup import import_tensorflow


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch")
    parser.add_argument("--image-size", type=int, default=28)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", required=True)
    parser.add_argument("--verbose", action="store_true")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    tf = import_tensorflow(args.verbose)
    import keras

    import tfreduce.tensorflow.keras as hvd
    from tfreduce.basis.contract import shard_sizes
    from tfreduce.trainer.models import image_cnn

    hvd.init()
    batch, side, num_classes, num_batches = args.batch_size, args.image_size, 10, 8
    rng = np.random.default_rng(0)  # the train mode's images
    x = rng.random((batch * num_batches, side, side, 1), dtype=np.float32)
    y = rng.integers(0, num_classes, size=batch * num_batches).astype(np.int32)
    sizes = shard_sizes(batch, hvd.size())
    start = sum(sizes[:hvd.rank()])
    rows = np.concatenate([np.arange(b * batch + start, b * batch + start + sizes[hvd.rank()])
                           for b in range(num_batches)])
    dataset = tf.data.Dataset.from_tensor_slices((x[rows], y[rows])).batch(
        sizes[hvd.rank()], drop_remainder=True).repeat()
    model = image_cnn(x.shape[1:], num_classes)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    stamps = []

    class StepClock(keras.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            float(logs["loss"])  # waits for the step
            stamps.append(time.perf_counter())

    def fit_round(steps, callbacks=()):
        stamps.clear()
        model.fit(dataset, epochs=1, steps_per_epoch=steps + 1, verbose=0,
                  callbacks=[StepClock(), *callbacks])
        return stamps[-1] - stamps[0]

    # The first call traces, and starts every process from rank 0's weights;
    # the callback stays, as in Horovod's scripts (it then times the batches
    # for the watchdog's straggler report).
    broadcast = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
    fit_round(max(args.warmup, 1), [broadcast])
    rates = [args.steps * batch / fit_round(args.steps, [broadcast])
             for _ in range(args.rounds)]
    if hvd.rank() == 0:
        with open(args.json, "w") as f:
            json.dump({"processes": hvd.size(), "rates": rates}, f)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
