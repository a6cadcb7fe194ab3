"""The trainer's settings that shape a step's graph, checked once."""

import dataclasses
import functools
import warnings
from collections.abc import Callable

from tfreduce.algorithms.powersgd import PowerSGD
from tfreduce.choice.reduction import as_reduction
from tfreduce.trainer.determinism import DEFAULT_MICRO_BATCHES, check_deterministic, fix_order
from tfreduce.trainer.update import check_update_options
from tfreduce.trainer.zero import check_zero_across, check_zero_stage


def trainer_reduction(algorithm, reduction, powersgd, options):
    """The trainer's Reduction and PowerSGD, from its arguments.

    ``compression=tfreduce.PowerSGD(...)``, the older spelling, still
    works: it moves to ``powersgd`` with a DeprecationWarning.

    Args:
      algorithm: str, the trainer's ``algorithm``.
      reduction: a tfreduce.Reduction, or None.
      powersgd: a tfreduce.PowerSGD, or None.
      options: dict of the trainer's other keywords (Reduction's fields).

    Returns:
      (tfreduce.Reduction, tfreduce.PowerSGD or None).

    Raises:
      TypeError, ValueError: as ``tfreduce.Reduction``; a PowerSGD class
        where an instance is needed; PowerSGD given twice.
    """
    options = dict(options)
    compression = options.get("compression")
    if isinstance(compression, PowerSGD) or compression is PowerSGD:
        warnings.warn("ReplicatedTrainer(compression=tfreduce.PowerSGD(...)) is deprecated: "
                      "pass powersgd=tfreduce.PowerSGD(...)", DeprecationWarning, stacklevel=3)
        if powersgd is not None:
            raise TypeError("PowerSGD given twice: pass it as powersgd= only")
        powersgd = _check_powersgd(options.pop("compression"), "compression")
    else:
        powersgd = _check_powersgd(powersgd, "powersgd")
    return as_reduction(algorithm, reduction, options), powersgd


def deterministic_options(options, micro_batches):
    """The step's options with ``micro_batches`` M set when the reduction is deterministic.

    A deterministic step scales each micro-batch's gradient itself, so its
    reduction sums (``average`` False: the same mean either way). It fixes
    the order of the sums for the whole process: TF's op determinism on,
    and the Grappler passes that regroup sums off (``algorithms.tree``).

    Raises:
      TypeError: micro_batches given without deterministic=True, or not an int.
      ValueError: as ``determinism.check_deterministic``.
    """
    if not options.reduction.deterministic:
        if micro_batches is not None:
            raise TypeError(f"micro_batches={micro_batches!r} splits the batch of a "
                            f"deterministic step: pass deterministic=True too")
        return options
    count = DEFAULT_MICRO_BATCHES if micro_batches is None else micro_batches
    check_deterministic(count, options.total_towers, len(options.devices),
                        options.accumulate_steps, options.powersgd)
    fix_order()
    return dataclasses.replace(options, micro_batches=count, average=False)


def _check_powersgd(powersgd, keyword):
    if powersgd is PowerSGD:
        raise TypeError(f"{keyword}=tfreduce.PowerSGD needs an instance: PowerSGD(rank=2)")
    if powersgd is not None and not isinstance(powersgd, PowerSGD):
        raise TypeError(f"powersgd must be a tfreduce.PowerSGD or None, got "
                        f"{type(powersgd).__name__} {powersgd!r}")
    return powersgd


def check_trainer_options(average, bcast_period, accumulate_steps, on_nonfinite, zero_stage=0,
                          powersgd=None):
    """Checks the ReplicatedTrainer's arguments that need neither a cluster nor devices.

    Raises:
      ValueError, TypeError: as ReplicatedTrainer documents.
    """
    if isinstance(bcast_period, bool) or not isinstance(bcast_period, int) or bcast_period < 0:
        raise ValueError(
            f"bcast_period must be an int >= 0 (0: never re-broadcast), got {bcast_period!r}"
        )
    check_update_options(average, accumulate_steps, on_nonfinite)
    check_zero_stage(zero_stage, powersgd)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """The trainer's settings that shape a step's graph.

    Attributes:
      loss_fn: fn(y_true, y_pred) -> per-example losses.
      class_indices: bool, the loss takes class indices (whole numbers).
      average: bool, the all-reduce averages (True) or sums the gradients.
      total_towers: int T, the towers of all workers.
      devices: list of K canonical device names, this worker's towers.
      reduction: the tfreduce.Reduction of every all-reduce.
      cluster: the started tfreduce.Cluster, or a LocalCluster in a single
        process.
      accumulate_steps: int M >= 1, steps per update (gradient accumulation).
      on_nonfinite: "raise" or "skip", what a step with NaN or Inf
        gradients does.
      powersgd: a tfreduce.PowerSGD compressing the all-reduce, or None.
      zero_stage: int, 0 (every tower holds all optimizer state), 1 (the
        optimizer state is sharded) or 2 (the accumulation buffers too);
        see trainer.zero.
      micro_batches: int M, the micro-batches of a deterministic step
        (trainer.determinism), or 0: the reduction is not deterministic.
      jit_compile: False, True or "auto" (on GPUs only): each tower's forward
        and backward pass compiled with XLA (trainer.compiled).
    """

    loss_fn: Callable
    class_indices: bool
    average: bool
    total_towers: int
    devices: list
    reduction: object
    cluster: object
    accumulate_steps: int = 1
    on_nonfinite: str = "raise"
    powersgd: object = None
    zero_stage: int = 0
    micro_batches: int = 0
    jit_compile: object = False

    def describe(self):
        """The settings that shape the collectives, as text the workers compare."""
        return (f"reduction=({self.reduction.describe()}), average={self.average}, "
                f"accumulate_steps={self.accumulate_steps}, on_nonfinite={self.on_nonfinite}, "
                f"powersgd={self.powersgd!r}, zero_stage={self.zero_stage}, "
                f"micro_batches={self.micro_batches}")

    def check(self):
        """Checks the reduction against the devices now, as the first step would build it.

        Raises:
          ValueError: devices the reduction cannot use (groups that do not
            fit K, NCCL on CPUs, a topology too small or across workers);
            ZeRO with compression across workers (the cross-worker
            reduce-scatter moves the gradients in their own dtype).
        """
        check_zero_across(self.zero_stage, self.cluster, self.reduction)
        self.reduction.check_devices(self.devices, self.cluster)

    def allreduce(self, all_grads, average):
        """The trainer's all-reduce: within this process, or across the cluster.

        Args:
          all_grads: K x N list of tensors, all_grads[k][n] on devices[k].
          average: bool, mean instead of sum (over the towers of all workers).

        Returns:
          K x N list, out[k][n] the sum (or mean) over towers, on devices[k].
        """
        return self.reduction(all_grads, self.devices, average, cluster=self.cluster)

    @functools.cached_property
    def exact_reduction(self):
        """The reduction without wire compression (statistics, metrics, ZeRO's all-gather)."""
        return dataclasses.replace(self.reduction, compression="none")

    def allreduce_exact(self, all_grads, average):
        """As ``allreduce``, with no wire compression: for BatchNorm statistics and metrics.

        Compression is for gradients: a correct count or a loss sum in
        float16 would lose its exactness (or overflow), and a moving
        variance its precision.
        """
        return self.exact_reduction(all_grads, self.devices, average, cluster=self.cluster)
