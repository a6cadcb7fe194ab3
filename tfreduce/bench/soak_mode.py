"""The soak mode: thousands of steps of the example's CNN, watching retracing and memory.

``ReplicatedTrainer.fit`` trains ``tfreduce.trainer.models.image_cnn`` on random
images for ``--soak-steps`` steps on ``--devices`` K devices of this process.
Each epoch has 8 full global batches and a smaller last one of B/2 + 1
images, so shard sizes change between steps (uneven when K does not divide
them) as in real data sets. After every epoch it records the process's
resident memory (Linux ``/proc/self/statm``) and how often each step
function was traced. A sound run keeps every trace count at 1 and its
memory flat once the first epoch has paid for tracing and TF's caches.
"""

import math
import os
import time

import numpy as np

from tfreduce.basis.devices import logical_devices
from tfreduce.bench.harness import environment
from tfreduce.bench.tables import print_table

__all__ = ["run", "print_result"]

_FULL_BATCHES = 8


def _resident_mb():
    """This process's resident memory in MB (1e6 bytes), from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e6


def run(args, log):
    """The soak mode; returns the JSON-ready result dict.

    Args:
      args: argparse.Namespace from ``cli.parse_args`` (devices, device_type,
        soak_steps, batch_size, image_size, algorithms).
      log: callable(str), progress lines.

    Returns:
      dict with keys mode, config, samples (one per epoch: step, resident
      MB, trace counts, seconds), summary (memory growth after the first
      epoch in MB, final trace counts, steps per second) and environment.
    """
    import keras

    from tfreduce.trainer import ReplicatedTrainer
    from tfreduce.trainer.models import image_cnn

    devices = logical_devices(args.devices, args.device_type)
    batch, side = args.batch_size, args.image_size
    examples = _FULL_BATCHES * batch + batch // 2 + 1
    rng = np.random.default_rng(0)
    x = rng.random((examples, side, side, 1), dtype=np.float32)
    y = rng.integers(0, 10, size=examples).astype(np.int32)
    algorithm = (args.algorithms or ["auto"])[0]
    trainer = ReplicatedTrainer(
        lambda: image_cnn((side, side, 1), 10),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        lambda: keras.optimizers.Adam(1e-3), devices=devices, algorithm=algorithm, cluster=None)
    steps_per_epoch = _FULL_BATCHES + 1
    samples, start = [], time.perf_counter()

    def sample(epoch, logs):
        samples.append({"step": trainer.step, "resident_mb": _resident_mb(),
                        "traces": trainer.tracing_counts(),
                        "seconds": time.perf_counter() - start})
        if epoch % 20 == 0:
            log(f"step {trainer.step}: {samples[-1]['resident_mb']:.0f} MB, "
                f"traces {samples[-1]['traces']}")

    trainer.fit(x, y, epochs=math.ceil(args.soak_steps / steps_per_epoch), batch_size=batch,
                validation_data=(x[:batch], y[:batch]), callbacks=[sample], verbose=0)
    first, last = samples[0], samples[-1]
    return {
        "mode": "soak",
        "config": {"devices": devices, "algorithm": algorithm, "batch_size": batch,
                   "last_batch": examples - _FULL_BATCHES * batch, "image_size": side,
                   "steps": last["step"]},
        "samples": samples,
        "summary": {
            "growth_mb_after_first_epoch": last["resident_mb"] - first["resident_mb"],
            "traces": last["traces"],
            "steps_per_s": (last["step"] - first["step"]) / (last["seconds"] - first["seconds"]),
        },
        "environment": environment(),
    }


def print_result(result, out=None):
    """Prints the memory and trace counts of about ten evenly spaced epochs, then the summary."""
    cfg, summary = result["config"], result["summary"]
    samples = result["samples"]
    shown = samples[::max(1, len(samples) // 10)]
    if shown[-1] is not samples[-1]:
        shown.append(samples[-1])
    title = (f"soak: {cfg['steps']} steps, K={len(cfg['devices'])}, {cfg['algorithm']}, "
             f"global batch {cfg['batch_size']} (last of each epoch {cfg['last_batch']}); "
             f"growth after the first epoch {summary['growth_mb_after_first_epoch']:+.1f} MB, "
             f"traces {summary['traces']}, {summary['steps_per_s']:.0f} steps/s")
    header = f"{'step':>7s} {'resident MB':>12s} {'train traces':>13s} {'eval traces':>12s}"
    print_table(title, header, [
        f"{s['step']:7d} {s['resident_mb']:12.1f} {s['traces']['train']:13d} "
        f"{s['traces']['evaluate']:12d}" for s in shown], out)
