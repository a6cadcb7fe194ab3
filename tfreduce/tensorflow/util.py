"""Horovod's ``horovod.tensorflow.util``, as far as scripts reach into it.

Horovod's scripts and tests ask ``hvd._executing_eagerly()`` (or
``hvd.util._executing_eagerly()``) whether they build a TF1 graph or run
eagerly; that is the only name of Horovod's helper module kept here.

Sources: Horovod's API (horovod.tensorflow.util).
"""

import tensorflow as tf

__all__ = ["_executing_eagerly"]


def _executing_eagerly():
    """bool: ops run eagerly now (False in a tf.compat.v1 graph or while a tf.function traces)."""
    return tf.executing_eagerly()
