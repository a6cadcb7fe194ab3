"""AutoGraph leaves tfreduce's code alone inside a user's tf.function.

A ``tf.function`` converts, line by line, every function its Python calls
unless that function is marked ``do_not_convert``. Converted, tfreduce's graph
building traced 10-30 times slower (docs/architecture.md). Each test traces a
user's step with AutoGraph on and records, with ``sys.setprofile``, every
function that ran from AutoGraph's generated code: only the user's own
functions (the step and the helpers it calls) may be among them.
"""

import functools
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfreduce
import tfreduce.tensorflow as hvd
import tfreduce.tensorflow.keras as hvdk
from helpers import CPU_DEVICES

DEVICES = CPU_DEVICES[:2]


#: The functions of this file that a traced step calls, and the two-line
#: wrapper of ``do_not_convert``: a callable object (a ``Reduction``) is
#: reached through its class's ``__call__``, which AutoGraph converts before
#: the wrapper turns AutoGraph off for everything below it.
USER_CODE = {"step", "tower_grads", "tower_variables", "wrapper"}


class Converted:
    """Records the names of the converted functions that run inside its block.

    AutoGraph runs its converted copy of a function ``f`` as ``tf__f``, from
    a module it generated.
    """

    def __enter__(self):
        self.names = set()
        sys.setprofile(self.profile)
        return self

    def profile(self, frame, event, arg):
        name = frame.f_code.co_name
        if (event == "call" and name.startswith("tf__")
                and "__autograph_generated_file" in frame.f_code.co_filename):
            self.names.add(name[len("tf__"):])

    def __exit__(self, *exc):
        sys.setprofile(None)


def converted(step):
    """The converted functions that ran while `step` was traced with AutoGraph."""
    function = tf.function(step, autograph=True)
    with Converted() as record:
        function.get_concrete_function()
    return record.names


def tower_grads():
    """2 x 2 gradients, row k on DEVICES[k]."""
    out = []
    for k, device in enumerate(DEVICES):
        with tf.device(device):
            out.append([tf.fill([4, 3], float(k + 1)), tf.fill([5], float(k))])
    return out


@functools.cache
def tower_variables():
    """2 x 1 variables, made once (a tf.function may not make them on each trace)."""
    out = []
    for device in DEVICES:
        with tf.device(device):
            out.append([tf.Variable(tf.zeros([3]))])
    return out


DOORS = {
    "allreduce_grads": lambda: tfreduce.allreduce_grads(tower_grads(), DEVICES),
    "allreduce_grads_flat": lambda: tfreduce.allreduce_grads_flat(tower_grads(), DEVICES),
    "allreduce_grads_hierarchical": lambda: tfreduce.allreduce_grads_hierarchical(
        tower_grads(), DEVICES),
    "allreduce_grads_ring": lambda: tfreduce.allreduce_grads_ring(tower_grads(), DEVICES),
    "allreduce_grads_collective": lambda: tfreduce.allreduce_grads_collective(
        tower_grads(), DEVICES),
    "Reduction": lambda: tfreduce.Reduction("ring")(tower_grads(), DEVICES),
    "reduce_scatter": lambda: tfreduce.reduce_scatter(tower_grads(), DEVICES),
    "all_gather": lambda: tfreduce.all_gather(tower_grads(), DEVICES),
    "broadcast": lambda: tfreduce.broadcast(tower_grads(), DEVICES),
    "reduce": lambda: tfreduce.reduce(tower_grads(), DEVICES),
    "all_to_all": lambda: tfreduce.all_to_all(tower_grads(), DEVICES, algorithm="flat"),
    "broadcast_variables": lambda: tfreduce.broadcast_variables(tower_variables()),
    "max_replica_difference": lambda: tfreduce.max_replica_difference(tower_variables()),
    "split_and_merge_grad_list": lambda: tfreduce.merge_grad_list(*tfreduce.split_grad_list(
        [[(g, v)] for g, v in zip([tf.zeros([3])] * 2, [row[0] for row in tower_variables()])])),
}


@pytest.mark.parametrize("door", DOORS)
def test_no_function_of_a_door_is_converted(door):
    call = DOORS[door]

    def step():
        call()
        return tf.constant(0)

    assert converted(step) <= USER_CODE


@pytest.fixture
def one_process():
    hvd.init()
    yield
    hvd.shutdown()


HOROVOD = {
    "allreduce": lambda x: hvd.allreduce(x),
    "grouped_allreduce": lambda x: hvd.grouped_allreduce([x, 2 * x]),
    "allgather": lambda x: hvd.allgather(x),
    "grouped_allgather": lambda x: hvd.grouped_allgather([x, x]),
    "broadcast": lambda x: hvd.broadcast(x, 0),
    "reducescatter": lambda x: hvd.reducescatter(x),
    "grouped_reducescatter": lambda x: hvd.grouped_reducescatter([x]),
    "alltoall": lambda x: hvd.alltoall(x),
    "broadcast_variables": lambda x: hvd.broadcast_variables(tower_variables()[0], 0),
}


@pytest.mark.parametrize("function", HOROVOD)
def test_no_function_of_the_horovod_api_is_converted(one_process, function):
    call = HOROVOD[function]

    def step():
        call(tf.ones([4, 2]))
        return tf.constant(0)

    assert converted(step) <= USER_CODE


def test_the_tape_and_the_optimizer_of_a_custom_loop_are_not_converted(one_process):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1))
    optimizer.build(model.trainable_variables)
    x = tf.constant(np.ones((4, 3), np.float32))

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    assert converted(step) <= USER_CODE


def test_the_trainer_traces_its_steps_without_autograph():
    trainer = tfreduce.ReplicatedTrainer(
        lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        lambda: keras.optimizers.SGD(0.1), devices=DEVICES)
    x = np.ones((8, 3), np.float32)
    y = np.zeros(8, np.int32)
    with Converted() as record:
        trainer.fit(x, y, batch_size=4, epochs=1, verbose=0)
        trainer.evaluate(x, y, batch_size=4)
        trainer.predict(x, batch_size=4)
    assert trainer.tracing_counts() == {"train": 1, "evaluate": 1, "predict": 1}
    assert record.names == set()
