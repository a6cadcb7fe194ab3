"""Trains with zero_stage=1 at K=4, saves, and is killed by SIGKILL during its second save.

Usage: zero_save_worker.py CHECKPOINT_DIR. Writes ckpt-1 and, beside it,
ckpt-1.npz with every optimizer slot gathered whole; then trains on and
saves again, killing itself once the second checkpoint's files are written
and before the index names it.
"""

import os
import signal
import sys

import numpy as np
import tensorflow as tf
from tensorflow.python.checkpoint import checkpoint_management


def main(path):
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 4)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))
    from test_zero import data, gathered_slots, trainer

    t = trainer(4, 1)
    x, y = data(16)
    for _ in range(3):
        t.train_step(x, y)
    t.save(path)
    np.savez(os.path.join(path, "ckpt-1.npz"), **gathered_slots(t))
    t.train_step(x, y)

    def killed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    checkpoint_management.update_checkpoint_state_internal = killed
    t.save(path)


if __name__ == "__main__":
    main(sys.argv[1])
