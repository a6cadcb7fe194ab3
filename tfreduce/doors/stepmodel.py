"""Predicts a data-parallel training step: compute, then each bucket's reduction as it is ready.

``predict_step`` puts the compute side beside the cost model's reduction:

- compute: every tower runs the model's forward pass, then its backward
  pass in reverse layer order. A layer's forward pass costs its
  multiply-adds times 2 FLOPs per example, its backward pass twice that
  (the gradients of its input and of its weights), at a sustained rate
  of FLOP/s per device. Layers without multiply-adds (normalisation,
  activations, pooling) are left out: they are memory-bound and short
  beside convolutions on GPUs. Or, measured (``compute=``): each layer's
  forward and backward time from the timeline of profiled steps on this
  host (``layer_seconds``: the towers' ops, stretched to the span they
  took, so the executor's gaps count);
- gradients: a layer's gradients exist once the backward pass has gone
  through it, so the last layer's are ready first;
- the reduction: tfreduce builds the chosen reduction on the devices of
  the topology and ``tfreduce.predict`` simulates it with each gradient
  ready at that time (bucket by bucket, in backward order), or, without
  overlap, with every gradient ready when the backward pass ends.

Exposed communication is the part of the step during which the reduction
runs and no tower computes: the reduction's end minus the backward pass's
end, when later. The optimizer's update then follows on every tower: its
measured time with ``compute=``; with FLOPs it is not modelled (0).

The sustained rates of the GPU presets (``SUSTAINED_FLOPS``) come from
NVIDIA's published ResNet-50 v1.5 training throughput on one GPU
(DeepLearningExamples, TensorFlow/Classification/ConvNets/resnet50v1.5,
20.06 container with XLA): 412 images/s on a V100 16 GB in FP32 and 808
images/s on an A100 40 GB in TF32, times 24.5 GFLOP per image (3 x the
forward pass's 4.09 G multiply-adds, as torchvision counts ResNet-50
v1.5). That is 64% of the V100's 15.7 TFLOP/s FP32 peak and 13% of the
A100's 156 TFLOP/s TF32 peak: an estimate of what a whole step sustains,
not of each layer.
"""

import collections
import dataclasses
import math
import numbers
import os

import tensorflow as tf

from tfreduce.analysis.costmodel import predict
from tfreduce.analysis.profiler import architecture
from tfreduce.analysis.timeline import Slice, Timeline
from tfreduce.basis.contract import is_int
from tfreduce.basis.topology import check_topology
from tfreduce.choice.reduction import Reduction

__all__ = ["SUSTAINED_FLOPS", "StepPrediction", "layer_flops", "layer_seconds", "predict_step"]

#: FLOP/s one device of a preset sustains on a training step (module docstring).
SUSTAINED_FLOPS = {
    "dgx1-v100": 412 * 24.5e9,
    "dgx-a100": 808 * 24.5e9,
}


@dataclasses.dataclass(frozen=True)
class StepPrediction:
    """What ``predict_step`` found; times in seconds from the step's start.

    Attributes:
      seconds: float, the step: the later of the backward pass's end and
        the reduction's, then the update.
      compute_seconds: float, forward and backward pass of one tower.
      apply_seconds: float, the optimizer's update on one tower once every
        reduced gradient is there: measured with ``compute=``, else 0 (not
        modelled).
      exposed_seconds: float, the reduction's time after the backward pass.
      exposed_fraction: float, exposed_seconds / seconds.
      exposed_without_overlap: float, the same reduction started only once
        every gradient exists (its whole time is exposed).
      ready: list of N floats, when variable n's gradient exists.
      timeline: tfreduce.analysis.timeline.Timeline: forward and backward slices per
        tower, the reduction's slices, and the links.
    """

    seconds: float
    compute_seconds: float
    apply_seconds: float
    exposed_seconds: float
    exposed_fraction: float
    exposed_without_overlap: float
    ready: list
    timeline: Timeline


def layer_flops(layer):
    """FLOPs of one example's forward pass through a built Keras layer (2 per multiply-add).

    Conv1D/2D/3D (groups too), DepthwiseConv2D and Dense count; other layers
    are 0. A layer inside a nested model counts through that model.

    Raises:
      ValueError: the layer is not built into a model (no output shape), or
        its output's sizes beyond the batch are not all known.
    """
    import keras

    if isinstance(layer, keras.Model):
        return sum(layer_flops(inner) for inner in layer.layers)
    if not isinstance(layer, (keras.layers.Dense, keras.layers.Conv1D, keras.layers.Conv2D,
                              keras.layers.Conv3D, keras.layers.DepthwiseConv2D)):
        return 0
    try:
        out = layer.output.shape
    except (AttributeError, ValueError) as error:
        raise ValueError(f"layer {layer.name!r} has no output shape: build the model on an "
                         f"Input of known shape ({error})") from None
    if any(size is None for size in out[1:]):
        raise ValueError(f"layer {layer.name!r} has output shape {tuple(out)}, whose sizes "
                         f"are not all known: build the model on an Input of known shape "
                         f"(keras.Input((224, 224, 3)), not (None, None, 3))")
    kernel = layer.kernel.shape
    if isinstance(layer, keras.layers.Dense):
        # kernel [in, units]; one product per output element and input.
        return 2 * math.prod(out[1:]) * kernel[0]
    if isinstance(layer, keras.layers.DepthwiseConv2D):
        return 2 * math.prod(out[1:]) * math.prod(kernel[:2])
    # Conv: kernel [k..., in / groups, filters]; channels last.
    return 2 * math.prod(out[1:]) * math.prod(kernel[:-1])


def layer_seconds(timeline, model):
    """Each layer's forward and backward time on one tower and step, from a measured Timeline.

    A tower's forward op belongs to layer i when its name is inside a
    scope the timeline names for layer i (``Timeline.layers``, found when
    the steps were profiled: ``tfreduce.analysis.profiler.layer_scopes``), its
    backward op likewise after "gradient_tape/". The ops of no such scope
    (the loss and its gradient, the ops of layers without variables) go
    under None.
    In each step, a tower's ops are scaled to the span they took, from
    its first forward op's start to its last backward op's end, so the
    executor's time between ops (and, on logical CPU devices that share
    the cores, each op's wait for one) counts as the layers' own, and ops
    that ran side by side count once; a layer's time is then the sum of
    its ops', averaged over the tower tracks and the profiled steps.

    Args:
      timeline: a tfreduce.analysis.timeline.Timeline of profiled steps
        (``fit(profile_steps=)``; ``Timeline.load`` reads its
        timeline.json.gz), or the path of that file.
      model: the keras.Model the steps trained, or one built alike: layer
        i of the timeline is ``model.layers[i]``.

    Returns:
      dict {layer name or None: (forward seconds, backward seconds)}, the
      times ``predict_step(..., compute=timeline)`` schedules.

    Raises:
      ValueError: the timeline has no profiled step, no forward or
        backward op on a tower track, no layer scope; its steps trained
        another model (layer classes and variable shapes differ; in a
        timeline saved without them, a layer index ``model`` does not
        have).
    """
    timeline = _as_timeline(timeline, "layer_seconds: timeline")
    steps = sum(1 for s in timeline.slices if s.op_type == "step")
    towers = {s.track for s in timeline.slices
              if s.track.startswith("tower ") and s.stage in ("forward", "backward")}
    if not steps or not towers or not timeline.layers:
        raise ValueError(f"the {timeline.source} timeline has {steps} profiled step(s), "
                         f"{len(towers)} tower track(s) with forward or backward ops and "
                         f"{len(timeline.layers)} layer scope(s): predict_step needs the "
                         f"profiled steps of a ReplicatedTrainer (fit(profile_steps=))")
    _check_same_model(timeline, model)
    totals = collections.defaultdict(lambda: [0.0, 0.0])
    for ops in _tower_steps(timeline, towers, ("forward", "backward")).values():
        # Scaled to the tower's span: the executor's time between its ops
        # and, on shared cores, the wait for one count as the layers'; ops
        # that overlapped (the inter-op pool) count once.
        span = max(s.end for s in ops) - min(s.start for s in ops)
        stretch = span / max(sum(s.duration for s in ops), 1e-12)
        for s in ops:
            scope = s.name.removeprefix("gradient_tape/")
            while scope and scope not in timeline.layers:
                scope = scope.rpartition("/")[0]
            layer = model.layers[timeline.layers[scope]].name if scope else None
            totals[layer][s.stage == "backward"] += s.duration * stretch
    scale = 1.0 / (steps * len(towers))
    return {name: (forward * scale, backward * scale) for name, (forward, backward)
            in totals.items()}


def _as_timeline(value, argument):
    # A Timeline, or the one a path names (Timeline.load's OSError and ValueError).
    if isinstance(value, Timeline):
        return value
    if isinstance(value, (str, os.PathLike)):
        return Timeline.load(value)
    raise TypeError(f"{argument} must be a tfreduce.analysis.timeline.Timeline or the path of "
                    f"its saved file, got {type(value).__name__} {value!r:.80}")


def _check_same_model(timeline, model):
    # Raises ValueError unless model is the one the timeline's steps trained
    # (or one built alike): layer by layer, its class and variable shapes.
    theirs, mine = timeline.architecture, architecture(model)
    if not theirs:
        # Saved without them: only the layer indices can be checked.
        deepest = max(timeline.layers.values())
        if deepest >= len(model.layers):
            raise ValueError(f"the timeline has layer {deepest} but model {model.name!r} has "
                             f"{len(model.layers)} layers: pass the model the steps trained")
        return
    if theirs == mine:
        return
    i = next((i for i, (a, b) in enumerate(zip(theirs, mine)) if a != b),
             min(len(theirs), len(mine)))
    raise ValueError(f"the {timeline.source} timeline's steps trained another model than "
                     f"{model.name!r}: layer {i} is {_described(theirs, i)} there and "
                     f"{_described(mine, i)} here ({len(theirs)} layers there, {len(mine)} "
                     f"here): pass the model the steps trained, or one built alike")


def _described(layers, i):
    if i >= len(layers):
        return "missing"
    name, shapes = layers[i]
    return f"{name} with variables {[tuple(shape) for shape in shapes]}"


def _tower_steps(timeline, towers, stages):
    # {(tower track, step): its slices of these stages in that step}.
    windows = [s for s in timeline.slices if s.op_type == "step"]
    ops = collections.defaultdict(list)
    for s in timeline.slices:
        if s.stage in stages and s.track in towers:
            step = next((w.name for w in windows if w.start <= s.start < w.end), None)
            ops[(s.track, step)].append(s)
    return ops


def _apply_seconds(timeline):
    # The span of a tower's update ops in a step, averaged over the
    # towers' steps (0 without any).
    towers = {s.track for s in timeline.slices if s.track.startswith("tower ")}
    spans = [max(s.end for s in ops) - min(s.start for s in ops)
             for ops in _tower_steps(timeline, towers, ("apply",)).values()]
    return sum(spans) / len(spans) if spans else 0.0


def _flop_times(model, batch, flops_per_s):
    # [(name, trainable variables, forward s, backward s)] in layer order.
    out = []
    for layer in model.layers:
        seconds = layer_flops(layer) * batch / flops_per_s
        out.append((layer.name, layer.trainable_variables, seconds, 2 * seconds))
    return out


def _measured_times(model, timeline):
    # As _flop_times, from layer_seconds; the ops of no layer (the loss)
    # run after the last layer's forward pass and before its backward pass.
    times = layer_seconds(timeline, model)
    out = [(layer.name, layer.trainable_variables, *times.get(layer.name, (0.0, 0.0)))
           for layer in model.layers]
    if None in times:
        out.append(("(no layer)", [], *times[None]))
    return out


def _schedule(layers):
    # (forward end, {variable id: ready s}): the backward pass runs the
    # layers in reverse; a variable's gradient exists once its layer's has run.
    forward = sum(entry[2] for entry in layers)
    ready, now = {}, forward
    for _, variables, _, backward in reversed(layers):
        now += backward
        for v in variables:
            ready.setdefault(id(v), now)
    return forward, ready


def predict_step(model, batch_per_tower, topology, num_towers=8, reduction="auto",
                 flops_per_s=None, trace=None, compute=None):
    """Predicts one training step of ``model`` on ``num_towers`` devices of a machine.

    Args:
      model: a built keras.Model (keras.applications models with
        weights=None build without a download).
      batch_per_tower: int, examples per tower and step (with ``compute``,
        the batch its steps were measured at).
      topology: a tfreduce.Topology, a preset name ("dgx1-v100") or "host"
        (this machine's logical CPU devices, probed now).
      num_towers: int K, the first K devices of the topology ("/gpu:0"...).
      reduction: a tfreduce.Reduction or an algorithm name; its pack_bytes
        makes the buckets.
      flops_per_s: float FLOP/s each device sustains; None: the preset's
        ``SUSTAINED_FLOPS``.
      trace: None, or a path for the step's timeline (Timeline.save).
      compute: None, or a Timeline of profiled steps of this model, or of
        one built alike (or the path of its saved file): the layers'
        forward and backward times are then the measured ones
        (``layer_seconds``) instead of FLOPs at a rate, and the update
        takes its measured time.

    Returns:
      StepPrediction.

    Raises:
      TypeError: model not a keras.Model, batch_per_tower or num_towers
        not an int, flops_per_s not a number, topology, reduction or
        compute of another type.
      OSError: compute names a file that cannot be read.
      ValueError: batch_per_tower or num_towers < 1, flops_per_s not
        finite and > 0, more towers than the topology has devices, an
        unknown preset or algorithm; no flops_per_s and no compute for a
        topology without a published rate, both flops_per_s and compute;
        a model not built yet (a model without an Input is built on its
        first batch), with no trainable variable, or a layer without an
        output shape of known sizes; layer_seconds' errors (a timeline of
        another model) and predict's.
    """
    _check_step_arguments(model, batch_per_tower, num_towers, flops_per_s)
    topology = check_topology(topology)
    name = topology if isinstance(topology, str) else topology.name
    if name != "host" and num_towers > topology.num_devices:
        raise ValueError(f"predict_step: num_towers={num_towers}, but topology {name!r} has "
                         f"{topology.num_devices} devices: ask for at most that many, or use a "
                         f"topology of more (tfreduce.Topology.cluster)")
    if not isinstance(reduction, (Reduction, str)):
        raise TypeError(f"predict_step: reduction must be a tfreduce.Reduction or an algorithm "
                        f"name, got {type(reduction).__name__} {reduction!r:.80}")
    if compute is not None and flops_per_s is not None:
        raise ValueError("predict_step takes flops_per_s or a measured compute timeline, "
                         "not both")
    if compute is None and flops_per_s is None:
        if name not in SUSTAINED_FLOPS:
            raise ValueError(f"predict_step needs flops_per_s or a measured compute timeline "
                             f"for topology {name!r}: only {sorted(SUSTAINED_FLOPS)} have a "
                             f"published estimate")
        flops_per_s = SUSTAINED_FLOPS[name]
    variables = model.trainable_variables
    if not variables:
        raise ValueError(f"model {model.name!r} has no trainable variable to reduce")
    reduction = reduction if isinstance(reduction, Reduction) else Reduction(reduction)
    apply = 0.0
    if compute is None:
        layers = _flop_times(model, batch_per_tower, flops_per_s)
    else:
        compute = _as_timeline(compute, "predict_step: compute")
        layers, apply = _measured_times(model, compute), _apply_seconds(compute)
    forward, ready_of = _schedule(layers)
    ready = [ready_of.get(id(v), forward) for v in variables]
    compute_seconds = forward + sum(entry[3] for entry in layers)
    overlapped, alone = _reduce(variables, [ready, [compute_seconds] * len(variables)],
                                reduction, topology, num_towers)
    reduced = max(compute_seconds, overlapped.seconds)
    slices = overlapped.timeline.slices + _compute_slices(layers, num_towers)
    if apply:
        slices += [Slice(f"tower {k}", "apply", "update", "apply", reduced, apply)
                   for k in range(num_towers)]
    timeline = Timeline(slices, f"predicted step: {name}", origin=0.0)
    if trace is not None:
        timeline.save(trace)
    exposed = reduced - compute_seconds
    step = reduced + apply
    return StepPrediction(step, compute_seconds, apply, exposed, exposed / step,
                          max(0.0, alone.seconds - compute_seconds), ready, timeline)


def _check_step_arguments(model, batch_per_tower, num_towers, flops_per_s):
    # predict_step's own arguments; the topology, reduction and compute
    # timeline are checked by what reads them.
    import keras

    if not isinstance(model, keras.Model):
        raise TypeError(f"predict_step: model must be a built keras.Model, got "
                        f"{type(model).__name__} {model!r:.80}")
    for name, value in (("batch_per_tower", batch_per_tower), ("num_towers", num_towers)):
        if not is_int(value):
            raise TypeError(f"predict_step: {name} must be an int >= 1, got "
                            f"{type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"predict_step: {name} must be an int >= 1, got {value!r}")
    if flops_per_s is not None:
        rate = ("predict_step: flops_per_s must be a finite number of FLOP/s > 0, or None "
                "(the topology's published rate)")
        if isinstance(flops_per_s, bool) or not isinstance(flops_per_s, numbers.Real):
            raise TypeError(f"{rate}, got {type(flops_per_s).__name__} {flops_per_s!r}")
        if not (math.isfinite(flops_per_s) and flops_per_s > 0):
            raise ValueError(f"{rate}, got {flops_per_s!r}")
    if not model.built:
        raise ValueError(f"predict_step: model {model.name!r} is not built yet (Keras builds "
                         f"a model without an Input on its first batch, and the prediction "
                         f"needs its variables and each layer's output shape): build it "
                         f"first, model.build((None, *input_shape)), or start it with "
                         f"keras.Input(input_shape)")


def _compute_slices(layers, num_towers):
    # Every tower's forward slices, then its backward slices in reverse.
    slices = []
    for k in range(num_towers):
        start = 0.0
        for stage, order in (("forward", layers), ("backward", layers[::-1])):
            for layer, _, forward, backward in order:
                seconds = forward if stage == "forward" else backward
                if seconds:
                    slices.append(Slice(f"tower {k}", layer, "layer", stage, start, seconds))
                start += seconds
    return slices


def _reduce(variables, readies, reduction, topology, num_towers):
    # The reduction of K x N float32 gradients of the variables' shapes on
    # "/gpu:k", built once and simulated for each list of ready times
    # (variable n's gradients ready at ready[n]); one Prediction each.
    devices = [f"/gpu:{k}" for k in range(num_towers)]
    with tf.Graph().as_default():
        grads = []
        for k, device in enumerate(devices):
            with tf.device(device):
                grads.append([tf.compat.v1.placeholder(tf.float32, v.shape, name=f"t{k}_g{n}")
                              for n, v in enumerate(variables)])
        out = reduction(grads, devices, average=True)
        return [predict(out, topology, inputs=grads,
                        ready={g.op: ready[n] for row in grads for n, g in enumerate(row)})
                for ready in readies]
