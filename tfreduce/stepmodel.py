"""Predicts a data-parallel training step: compute, then each bucket's reduction as it is ready.

``predict_step`` puts the compute side beside the cost model's reduction:

- compute: every tower runs the model's forward pass, then its backward
  pass in reverse layer order. A layer's forward pass costs its
  multiply-adds times 2 FLOPs per example, its backward pass twice that
  (the gradients of its input and of its weights), at a sustained rate
  of FLOP/s per device. Layers without multiply-adds (normalisation,
  activations, pooling) are left out: they are memory-bound and short
  beside convolutions on GPUs;
- gradients: a layer's gradients exist once the backward pass has gone
  through it, so the last layer's are ready first;
- the reduction: tfreduce builds the chosen reduction on the devices of
  the topology and ``tfreduce.predict`` simulates it with each gradient
  ready at that time (bucket by bucket, in backward order), or, without
  overlap, with every gradient ready when the backward pass ends.

Exposed communication is the part of the step during which the reduction
runs and no tower computes: the reduction's end minus the backward pass's
end, when later. The optimizer's update after the reduction is not
modelled.

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

import dataclasses
import math

import tensorflow as tf

from tfreduce.costmodel import predict
from tfreduce.reduction import Reduction
from tfreduce.timeline import Slice, Timeline

__all__ = ["SUSTAINED_FLOPS", "StepPrediction", "layer_flops", "predict_step"]

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
        the reduction's.
      compute_seconds: float, forward and backward pass of one tower.
      exposed_seconds: float, the reduction's time after the backward pass.
      exposed_fraction: float, exposed_seconds / seconds.
      exposed_without_overlap: float, the same reduction started only once
        every gradient exists (its whole time is exposed).
      ready: list of N floats, when variable n's gradient exists.
      timeline: tfreduce.timeline.Timeline: forward and backward slices per
        tower, the reduction's slices, and the links.
    """

    seconds: float
    compute_seconds: float
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
      ValueError: the layer is not built into a model (no output shape).
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
    kernel = layer.kernel.shape
    if isinstance(layer, keras.layers.Dense):
        # kernel [in, units]; one product per output element and input.
        return 2 * math.prod(out[1:]) * kernel[0]
    if isinstance(layer, keras.layers.DepthwiseConv2D):
        return 2 * math.prod(out[1:]) * math.prod(kernel[:2])
    # Conv: kernel [k..., in / groups, filters]; channels last.
    return 2 * math.prod(out[1:]) * math.prod(kernel[:-1])


def _schedule(model, batch, flops_per_s):
    # (forward end, [(layer, forward s, backward s)], {variable id: ready s}).
    layers = [(layer, layer_flops(layer) * batch / flops_per_s) for layer in model.layers]
    forward = sum(seconds for _, seconds in layers)
    ready, now = {}, forward
    timed = []
    for layer, seconds in reversed(layers):
        now += 2 * seconds
        timed.append((layer, seconds, 2 * seconds))
        for v in layer.trainable_variables:
            ready.setdefault(id(v), now)
    return forward, timed[::-1], ready


def predict_step(model, batch_per_tower, topology, num_towers=8, reduction="auto",
                 flops_per_s=None, trace=None):
    """Predicts one training step of ``model`` on ``num_towers`` devices of a machine.

    Args:
      model: a built keras.Model (keras.applications models with
        weights=None build without a download).
      batch_per_tower: int, examples per tower and step.
      topology: a tfreduce.Topology or a preset name ("dgx1-v100").
      num_towers: int K, the first K devices of the topology ("/gpu:0"...).
      reduction: a tfreduce.Reduction or an algorithm name; its pack_bytes
        makes the buckets.
      flops_per_s: float FLOP/s each device sustains; None: the preset's
        ``SUSTAINED_FLOPS``.
      trace: None, or a path for the step's timeline (Timeline.save).

    Returns:
      StepPrediction.

    Raises:
      ValueError: no flops_per_s for this topology, a model with no
        trainable variable or a layer without an output shape, and
        predict's errors.
    """
    name = topology if isinstance(topology, str) else topology.name
    if flops_per_s is None:
        if name not in SUSTAINED_FLOPS:
            raise ValueError(f"predict_step needs flops_per_s for topology {name!r}: only "
                             f"{sorted(SUSTAINED_FLOPS)} have a published estimate")
        flops_per_s = SUSTAINED_FLOPS[name]
    variables = model.trainable_variables
    if not variables:
        raise ValueError(f"model {model.name!r} has no trainable variable to reduce")
    reduction = reduction if isinstance(reduction, Reduction) else Reduction(reduction)
    forward, layers, ready_of = _schedule(model, batch_per_tower, flops_per_s)
    ready = [ready_of.get(id(v), forward) for v in variables]
    compute = forward + sum(backward for _, _, backward in layers)
    overlapped, alone = _reduce(variables, [ready, [compute] * len(variables)], reduction,
                                topology, num_towers)
    end = max(compute, overlapped.seconds)
    slices = list(overlapped.timeline.slices)
    for k in range(num_towers):
        start = 0.0
        for layer, seconds, _ in layers:
            if seconds:
                slices.append(Slice(f"tower {k}", layer.name, "layer", "forward", start, seconds))
            start += seconds
        for layer, _, seconds in reversed(layers):
            if seconds:
                slices.append(Slice(f"tower {k}", layer.name, "layer", "backward", start,
                                    seconds))
            start += seconds
    timeline = Timeline(slices, f"predicted step: {name}", origin=0.0)
    if trace is not None:
        timeline.save(trace)
    exposed = max(0.0, overlapped.seconds - compute)
    return StepPrediction(end, compute, exposed, exposed / end,
                          max(0.0, alone.seconds - compute), ready, timeline)


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
