"""Profiled steps read into a Timeline: TensorFlow's profiler, its XPlane file, each op's place.

``StepProfiler`` runs steps under TensorFlow's profiler
(``tf.profiler.experimental``) and reads the ops it recorded from the
XPlane file it writes (op name and type, thread, start, duration); the
traced graphs place each op on its device (``placement``) and name each
layer's scope (``layer_scopes``). The result is a measured
``tfreduce.analysis.timeline.Timeline``.
"""

import glob
import os
import re
import tempfile
import time

import tensorflow as tf

from tfreduce.analysis.timeline import Slice, Timeline, stage_of
from tfreduce.basis.devices import canonical_or_empty

__all__ = ["StepProfiler", "architecture", "from_ops", "layer_scopes", "placement", "read_xspace",
           "track_names"]

_TOWER = re.compile(r"(^|/)tower(\d+)[/_]")


def track_names(devices):
    """{canonical device: "tower k"} for the towers' devices, in order."""
    return {canonical_or_empty(d): f"tower {k}" for k, d in enumerate(devices)}


def placement(graphs):
    """{op name: canonical device} of the ops of the graphs (a step's traced functions)."""
    return {op.name: canonical_or_empty(op.device)
            for graph in graphs for op in graph.get_operations()}


def architecture(model):
    """One [layer class name, [variable shape, ...]] per layer of a Keras model, in order.

    What a timeline keeps of the model its steps trained: a model built
    alike (other layer names, another process) has the same, another model
    not (``tfreduce.doors.stepmodel.layer_seconds`` checks it).
    """
    return [[type(layer).__name__, [list(v.shape) for v in layer.weights]]
            for layer in model.layers]


def layer_scopes(graphs, models):
    """{name scope: layer index} of the towers' forward ops, found through the layers' variables.

    Keras names a layer's ops after the layer, and TensorFlow adds ``_N``
    to keep a name scope unique in a graph ("dense" becomes "dense_1",
    which another layer may be called), so names alone are ambiguous. A
    ``ReadVariableOp`` of a variable of layer i of replica k, inside tower
    k's scope, is not: its name up to the deepest part that is the layer's
    name (with any ``_N``) is layer i's scope. Layers without variables
    (activations, pooling) have none.

    Args:
      graphs: the traced step graphs (their captures are the variables).
      models: the replicas, one keras.Model per tower, in tower order.
    """
    owner = {}
    for model in models:
        for i, layer in enumerate(model.layers):
            for variable in layer.weights:
                handle = getattr(getattr(variable, "value", variable), "handle", None)
                if handle is not None:
                    # The layer's scope: its name, with any _N TF added.
                    owner[handle.ref()] = (i, re.compile(re.escape(layer.name) + r"(_\d+)*"))
    scopes = {}
    for graph in graphs:
        inner = {internal.ref(): owner[external.ref()]
                 for external, internal in getattr(graph, "captures", ())
                 if external.ref() in owner}
        for op in graph.get_operations():
            if (op.type != "ReadVariableOp" or stage_of(op.name) != "forward"
                    or op.inputs[0].ref() not in inner):
                continue
            index, scope = inner[op.inputs[0].ref()]
            parts = op.name.split("/")
            hits = [j for j, part in enumerate(parts) if scope.fullmatch(part)]
            if hits:
                scopes["/".join(parts[:hits[-1] + 1])] = index
    return scopes


def _device_of(name, placed):
    # The op itself, else its nearest enclosing op (a lowered cond's branch
    # ops carry the cond's name as a prefix).
    while name:
        if name in placed:
            return placed[name]
        name = name.rpartition("/")[0]
    return ""


def read_xspace(path):
    """The TF ops an XPlane file recorded: list of (op name, op type, start ns, duration ns).

    Start times are ns since the epoch, as ``time.time_ns()``.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    # Lines count from the session's start (the "Task Environment" plane's
    # profile_start_time, ns since the epoch, as time.time_ns()).
    origin = 0
    for plane in space.planes:
        for stat in plane.stats:
            if plane.stat_metadata[stat.metadata_id].name == "profile_start_time":
                origin = stat.uint64_value or stat.int64_value
    ops = []
    for plane in space.planes:
        metadata = plane.event_metadata
        for line in plane.lines:
            for event in line.events:
                label = metadata[event.metadata_id].name
                # TF ops are recorded as "name:Type"; runtime events carry
                # "::" or ": " (EagerLocalExecute: f).
                if ":" not in label or "::" in label or ": " in label:
                    continue
                name, _, op_type = label.rpartition(":")
                start = origin + line.timestamp_ns + event.offset_ps // 1000
                ops.append((name, op_type, start, event.duration_ps // 1000))
    return ops


def from_ops(ops, placed, tracks, windows, source="measured", process="worker 0", layers=None,
             architecture=None):
    """A Timeline of profiled ops.

    Args:
      ops: list of (op name, op type, start ns, duration ns), read_xspace's.
      placed: {op name: canonical device}, see ``placement``.
      tracks: {canonical device: track name}, see ``track_names``; other
        devices go on "host".
      windows: list of (label, start ns, end ns): only ops inside one are
        kept, and each window becomes a "step" slice on the host track.
      source, process, layers, architecture: as Timeline's.
    """
    slices = []
    for label, start, end in windows:
        slices.append(Slice("host", label, "step", "other", start * 1e-9, (end - start) * 1e-9))
    for name, op_type, start, duration in ops:
        if not any(lo <= start < hi for _, lo, hi in windows):
            continue
        device = _device_of(name, placed)
        tower = _TOWER.search(name)
        if device in tracks:
            track = tracks[device]
        elif not device and tower:
            track = f"tower {tower.group(2)}"  # placed at run time: its scope's tower
        else:
            track = "host"
        slices.append(Slice(track, name, op_type, stage_of(name), start * 1e-9, duration * 1e-9))
    return Timeline(slices, source, process, layers=layers, architecture=architecture)


class StepProfiler:
    """Runs steps under TensorFlow's profiler and makes their Timeline.

    Use as a context manager around the steps; call ``step(label, fn)`` for
    each step to time it (only ops inside a step's window are kept).

    Args:
      logdir: directory the profiler writes its XPlane file under
        (``plugins/profile/<run>/``, where TensorBoard's profile plugin
        finds it too); None: a temporary directory, removed afterwards.
      devices: the towers' devices, in tower order.
      graphs: fn() -> the traced step graphs, called once the steps ran:
        they place each op (``placement``) and name each layer's scope.
      models: the replicas, one keras.Model per tower (``layer_scopes``).
      process: str, the track group's name ("worker 0").

    Attributes:
      timeline: the Timeline, once the context has exited.

    Raises:
      tf.errors.AlreadyExistsError: on entering, when another profiler runs
        in this process (TensorBoard's profile callback, a profiler server).
    """

    def __init__(self, logdir, devices, graphs, models, process="worker 0"):
        self._logdir = logdir
        self._devices = list(devices)
        self._graphs = graphs
        self._models = list(models)
        self._process = process
        self._windows = []
        self._tmp = None
        self.timeline = None

    def __enter__(self):
        if self._logdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tfreduce_profile")
            self._logdir = self._tmp.name
        tf.profiler.experimental.start(self._logdir)
        return self

    def step(self, label, fn, *args):
        """Returns fn(*args), timed as the step called ``label`` (a "step" slice on "host")."""
        start = time.time_ns()
        try:
            return fn(*args)
        finally:
            self._windows.append((label, start, time.time_ns()))

    def __exit__(self, *exc):
        try:
            tf.profiler.experimental.stop()
            if exc[0] is None:
                files = glob.glob(os.path.join(self._logdir, "plugins", "profile", "*",
                                               "*.xplane.pb"))
                newest = max(files, key=os.path.getmtime)
                graphs = self._graphs()
                self.timeline = from_ops(read_xspace(newest), placement(graphs),
                                         track_names(self._devices), self._windows,
                                         process=self._process,
                                         layers=layer_scopes(graphs, self._models),
                                         architecture=architecture(self._models[0]))
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()
        return False
