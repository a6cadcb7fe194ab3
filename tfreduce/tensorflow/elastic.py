"""Horovod's elastic API (``horovod.tensorflow.elastic``): training state that outlives a lost worker.

A script keeps what training must not lose in a State (the model, the
optimizer, the epoch and batch), commits it every few steps, and runs its
training function under ``run``::

    state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    train(state)

Under the elastic launcher (``tfreduce-launch --workers MIN:MAX``,
``tfreduce.workers.elastic_launch``) a lost worker or new slots make the job
re-form as a new generation of processes (``tfreduce.workers.generations``):
the mechanism is a fast restart, not a re-formed group inside the running
processes (TensorFlow's collective runtime cannot change its group in a
process). What carries over is each worker's last commit, which ``commit``
writes to the job's in-memory directory: in the next generation ``run``
reads it back (``restore``), calls the reset callbacks (``hvd.size()`` and
``hvd.rank()`` are the new ones), and syncs rank 0's state (the oldest
survivor's) to every worker before it calls the function. So a failure
rolls the job back to its last commit; a host update, which every worker
sees at the same commit (``check_host_updates``), loses nothing. Without
the elastic launcher ``run`` syncs and calls the function once.

Source: Horovod's elastic mode (horovod/common/elastic.py,
docs/elastic.rst): the same classes, methods and semantics.
"""

import copy
import functools
import pickle

import numpy as np
import tensorflow as tf

from tfreduce.basis import kerases
from tfreduce.tensorflow.functions import broadcast_object
from tfreduce.tensorflow.ops import allreduce, broadcast_variables
from tfreduce.tensorflow.process import size
from tfreduce.tensorflow.reduce_ops import Max
from tfreduce.workers import generations
from tfreduce.workers.failures import PEER_LOST

__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State", "TensorFlowKerasState",
           "TensorFlowState", "run"]


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by ``commit``/``check_host_updates`` on every worker at the same commit
    when slots were added or removed; ``run`` then re-forms the job, nothing lost.

    Attributes:
      skip_sync: bool, Horovod's flag (True when hosts were only removed).
    """

    def __init__(self, skip_sync=False):
        super().__init__("the job's hosts changed: it re-forms at this commit")
        self.skip_sync = skip_sync


class State:
    """The state of training that survives a re-forming (Horovod's ``State``).

    Subclasses say what is kept: ``save`` (to memory), ``restore`` (the
    last save), ``sync`` (rank 0's to every worker), and ``_payload`` /
    ``_load_payload`` (the commit as Python data, for the next generation).
    """

    def __init__(self):
        self._reset_callbacks = []
        self._worker = generations.elastic_worker()
        # The host updates this generation was started with: one after them
        # re-forms it, even if it came while this process was starting.
        self._updates_seen = 0 if self._worker is None else self._worker.updates_at_start

    def register_reset_callbacks(self, callbacks):
        """Adds functions of no argument, called after each re-forming once the new size is
        known (before the sync), e.g. to scale the learning rate with ``hvd.size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        """Runs the reset callbacks (``run`` calls it in every generation but the first)."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def reset(self):
        """What a subclass redoes after a re-forming (nothing by default)."""

    def commit(self):
        """Saves the state (to memory, and for the next generation under the elastic
        launcher), then checks for host updates (may raise HostsUpdatedInterrupt)."""
        self.save()
        if self._worker is not None:
            self._worker.write_commit(pickle.dumps(self._payload(), pickle.HIGHEST_PROTOCOL))
        self.check_host_updates()

    def check_host_updates(self):
        """Raises HostsUpdatedInterrupt on every worker at once if the launcher has slots to
        add or remove: the workers agree on the largest update count any of them read."""
        if self._worker is None:
            return
        count = self._worker.hosts_updates()
        if size() > 1:
            count = int(allreduce(tf.constant(count, tf.int64), op=Max).numpy())
        if count > self._updates_seen:
            self._updates_seen = count
            raise HostsUpdatedInterrupt()

    @property
    def _host_messages(self):
        """Horovod's queue of host updates, which its elastic test scripts poll:
        ``empty()`` is False once the launcher has an update this generation has not seen."""
        return _HostMessages(self)

    def save(self):
        """Copies the state to memory (what ``restore`` goes back to)."""
        raise NotImplementedError

    def restore(self):
        """Sets the state back to the last ``save`` (or ``sync``)."""
        raise NotImplementedError

    def sync(self):
        """Gives every worker rank 0's state (a collective: every worker calls it)."""
        raise NotImplementedError

    def _payload(self):
        raise NotImplementedError

    def _load_payload(self, payload):
        raise NotImplementedError

    def _restore_commit(self):
        """Loads this worker's commit of the last generation, if any: True if loaded."""
        data = None if self._worker is None else self._worker.read_commit()
        if data is None:
            return False
        self._load_payload(pickle.loads(data))
        self.restore()
        return True


class _HostMessages:
    """State._host_messages: only ``empty()``."""

    def __init__(self, state):
        self._state = state

    def empty(self):
        worker = self._state._worker
        return worker is None or worker.hosts_updates() <= self._state._updates_seen


class ObjectState(State):
    """Python values kept as attributes (Horovod's ``ObjectState``).

    Each keyword argument becomes an attribute; ``save`` copies their
    values, ``restore`` sets them back, ``sync`` gives every worker rank
    0's saved values.

    Args:
      bcast_object: function(obj) -> rank 0's obj (default: broadcast_object).
      get_rank: Horovod's argument, unused (the sync is rank 0's by definition).
      **kwargs: the values, picklable.
    """

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        del get_rank
        self._bcast_object = bcast_object or broadcast_object
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__()

    def save(self):
        self._saved_state = {name: copy.deepcopy(getattr(self, name))
                             for name in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self):
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))

    def _payload(self):
        return {"objects": self._saved_state}

    def _load_payload(self, payload):
        self._saved_state = payload["objects"]


class TensorFlowState(ObjectState):
    """A list of tf.Variables and Python values (Horovod's ``TensorFlowState``, TF2 only).

    Args:
      variables: list of tf.Variable.
      session: must be None (TF2).
      **kwargs: as ObjectState's.

    Raises:
      ValueError: no variables, or a session.
    """

    def __init__(self, variables=None, session=None, **kwargs):
        if session is not None or not variables:
            raise ValueError("TensorFlowState needs the list of variables (TF2 has no "
                             "global variables) and no session")
        self.variables = list(variables)
        self._values = [v.numpy() for v in self.variables]
        super().__init__(**kwargs)

    def save(self):
        self._values = [v.numpy() for v in self.variables]
        super().save()

    def restore(self):
        for v, value in zip(self.variables, self._values):
            v.assign(value)
        super().restore()

    def sync(self):
        broadcast_variables(self.variables, 0)
        self._values = [v.numpy() for v in self.variables]
        super().sync()

    def _payload(self):
        return {**super()._payload(), "variables": self._values}

    def _load_payload(self, payload):
        super()._load_payload(payload)
        self._values = _same_shapes(payload["variables"], self.variables, "variables")


class TensorFlowKerasState(ObjectState):
    """A Keras model, its optimizer and Python values (Horovod's ``TensorFlowKerasState``).

    Works with Keras 3 and tf_keras models. The optimizer's variables
    are kept once it has made them (its first update, or a restore).

    Args:
      model: a built Keras model.
      optimizer: its optimizer (default: ``model.optimizer``), or None.
      backend: Horovod's TF1 session argument; must be None.
      **kwargs: as ObjectState's (epoch, batch, ...).

    Raises:
      ValueError: the model is not built, or a backend is given.
    """

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if not model.built:
            raise ValueError("TensorFlowKerasState: build the model first "
                             "(model.build(input_shape), or call it on a batch)")
        if backend is not None:
            raise ValueError("TensorFlowKerasState: backend= is for TF1 sessions; TF2 takes none")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self._save_model()
        super().__init__(**kwargs)

    def _optimizer_variables(self, build=False):
        if self.optimizer is None:
            return []
        if build or kerases.optimizer_built(self.optimizer):
            return kerases.optimizer_variables(self.optimizer, self.model.trainable_variables)
        return []

    def _save_model(self):
        self._model_values = [v.numpy() for v in self.model.variables]
        self._optimizer_values = [v.numpy() for v in self._optimizer_variables()]

    def save(self):
        self._save_model()
        super().save()

    def restore(self):
        for v, value in zip(self.model.variables, self._model_values):
            v.assign(value)
        if self._optimizer_values:
            optimizer_variables = self._optimizer_variables(build=True)
            for v, value in zip(optimizer_variables, self._optimizer_values):
                v.assign(value)
        super().restore()

    def sync(self):
        variables = list(self.model.variables)
        # Rank 0 says whether its optimizer has variables; the others build theirs to match.
        if broadcast_object(bool(self._optimizer_variables())):
            variables += self._optimizer_variables(build=True)
        broadcast_variables([kerases.tf_variable(v) for v in variables], 0)
        self._save_model()
        super().sync()

    def _payload(self):
        return {**super()._payload(), "model": self._model_values,
                "optimizer": self._optimizer_values}

    def _load_payload(self, payload):
        super()._load_payload(payload)
        self._model_values = _same_shapes(payload["model"], self.model.variables, "model")
        self._optimizer_values = payload["optimizer"]


def _same_shapes(values, variables, what):
    """`values` (a commit's arrays) if they fit `variables`, else a ValueError naming the first."""
    if len(values) != len(variables):
        raise ValueError(f"the commit has {len(values)} {what} values but the state has "
                         f"{len(variables)} variables: the script must build the same model in "
                         "every generation")
    for value, v in zip(values, variables):
        if tuple(np.shape(value)) != tuple(v.shape):
            raise ValueError(f"the commit's value for {kerases.variable_name(v)} has shape "
                             f"{tuple(np.shape(value))}, the variable {tuple(v.shape)}")
    return values


def run(func):
    """Runs ``func(state, ...)`` so that the job survives lost and added workers (Horovod's ``run``).

    In a generation after the first, each worker first loads its own last
    commit (``restore``), then the reset callbacks run; in every generation
    rank 0's state is synced to every worker, and func is called. A host
    update (HostsUpdatedInterrupt) or a lost peer (WorkerLostError from its
    watchdog; TF's UnavailableError or AbortedError from the transport)
    ends this process with ``generations.RESHAPE_CODE``,
    for the launcher to start the next generation from the commits. Any
    other error propagates: the launcher, which sees a worker die at once,
    stops the others itself, and counts a failure only against the workers
    that died first. Without the elastic launcher every error propagates.

    Args:
      func: function(state, *args, **kwargs); it must not make collectives
        before its state is synced (no collective at its top).

    Returns:
      the wrapped function.
    """

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        worker = generations.elastic_worker()
        if worker is not None and worker.generation > 0:
            state._restore_commit()
            state.on_reset()
        state.sync()
        try:
            return func(state, *args, **kwargs)
        except HostsUpdatedInterrupt:
            if worker is None:
                raise
            generations.leave(f"the job's hosts changed at a commit: it re-forms (worker "
                              f"{worker.worker_id}, generation {worker.generation})")
        except PEER_LOST as error:
            if worker is None:
                raise
            generations.leave(generations.lost_peer(error, worker))

    return wrapper
