"""tfreduce-bench: all-reduce speed against tensorpack, tf.distribute and the memory floor.

Five modes, on K logical CPU devices (default) or K real GPUs:

``allreduce`` (default)
  Gradient shapes from a Keras application model (ResNet50 by default, built
  with ``weights=None``: nothing is downloaded) or N synthetic tensors,
  optionally rescaled to a total size. Contenders, all built into one graph
  on the same K x N inputs and run in one ``tf.compat.v1.Session``:

  - every tfreduce algorithm that runs on the devices, without packing and
    with packing (``--pack-bytes``, default ``choices.DEFAULT_PACK_BYTES``);
  - tensorpack's ``allreduce_grads_hierarchical`` (when installed; it
    asserts K == 8, so only then);
  - tf.distribute's ``HierarchicalCopyAllReduce`` (even K: it splits the
    devices into two equal halves and silently drops the last device of an
    odd K) and ``ReductionToOneDevice``, through their ``batch_reduce`` on
    ``PerReplica`` values, as MirroredStrategy calls them.

  TF collective ops (``CollectiveReduceV2``, TF's ring on CPUs) are the
  tfreduce ``collective`` contender. ``--compression none,fp16,bf16,powersgd4``
  runs every tfreduce variant with each compression and reports its
  busiest device pair's bytes and step time against the uncompressed one.

  Two reference rows are timed in the same run: ``floor``, one ``add_n`` on
  device 0 of K buffers of S bytes each (S = one tower's gradients), which
  reads K*S and writes S bytes, the least memory traffic any all-reduce on
  shared memory can make (a mean adds a pass over S to scale); and
  ``inputs``, which only reads the K x N input gradients, the per-op cost
  every contender pays before reducing anything.

``train``
  Images per second of ``tfreduce.ReplicatedTrainer.train_step`` against
  Keras ``model.fit`` under ``tf.distribute.MirroredStrategy``, with its
  default reduction and with ``tfreduce.CrossDeviceOps``, on the same model
  (the CNN of examples/image_classification.py), data and K.

``scaling``
  Build time, op count and step time of tfreduce algorithms for K devices x
  N small tensors over a grid of K and N, and both per K*N.

``soak``
  ``--soak-steps`` of ``fit``, watching retracing and memory.

``multiworker``
  W worker processes on 127.0.0.1 through the launcher, K devices each: one
  collective per tensor over all W x K devices (MultiWorkerMirroredStrategy's
  way) against ``allreduce_grads_multiworker``, uncompressed, with fp16
  across workers and with PowerSGD.

How it measures (allreduce and scaling): each contender's outputs are
consumed by one ``NoOp`` per device with control dependencies on that
device's outputs, joined by one ``NoOp`` that is fetched. The session runs
the graph as built: Grappler's meta optimizer is off (it removes ops whose
outputs only feed control dependencies, which would time nothing) and so
are common-subexpression elimination and constant folding. A check run
fetches every output once, compares it with NumPy's sum (inputs are
multiples of 1/4, so float32 sums are exact) and counts, from the run's step
stats, the contender's ops that did not run (0: nothing was pruned). Then
every contender, the floor and the inputs row run once per round, in an
order that rotates each round, for ``--steps`` rounds after ``--warmup``
untimed runs. The report gives medians and quartiles, ratios to the floor
and between all contenders, the graph-build time (CPU time of the building
thread, after a throwaway build of every contender has paid one-off costs)
and op count, and the cross-device bytes from ``tfreduce.analyze_traffic``.
``--json`` writes everything, ``--png`` draws a bar chart (matplotlib).

The train mode times steady-state steps: ``train_step`` returns the loss as
a float, and a Keras callback reads the loss after every ``fit`` step, so
both wait for each step; fit's per-call set-up and first step are left out.

    tfreduce-bench --devices 8 --model resnet50 --json resnet50.json
    python -m tfreduce.bench --model resnet50 --total-bytes 1MB --png 1mb.png

Modules, one job each: ``cli`` (options, ``main``), ``units`` (byte counts),
``workloads`` (gradient shapes), ``contenders`` (what is timed), ``harness``
(session, inputs, consumption, checks, timed rounds), ``tables`` (the
printed tables' frame), and one module per mode: ``allreduce_mode``,
``train_mode``, ``scaling_mode``, ``soak_mode``, ``multiworker_mode`` (and
``multiworker_worker``, what each of its workers runs).
"""

from tfreduce.bench.cli import main, parse_args
from tfreduce.bench.units import format_bytes, parse_bytes
from tfreduce.bench.workloads import gradient_shapes

__all__ = ["main", "parse_args", "parse_bytes", "format_bytes", "gradient_shapes"]
