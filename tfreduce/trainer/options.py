"""The trainer's settings that shape a step's graph, checked once."""

import dataclasses
from collections.abc import Callable

from tfreduce.allreduce import allreduce_grads
from tfreduce.compression import as_compressor
from tfreduce.contract import check_flag
from tfreduce.multiworker import (
    CROSS_WORKER_PACK_BYTES,
    allreduce_grads_multiworker,
    check_local_options,
)
from tfreduce.packing import check_pack_bytes
from tfreduce.planner import check_auto_options
from tfreduce.powersgd import PowerSGD
from tfreduce.registry import ALGORITHMS, choose_algorithm, make_stage
from tfreduce.trainer.update import check_update_options


def check_trainer_options(algorithm, average, bcast_period, accumulate_steps, on_nonfinite,
                          compression):
    """Checks the ReplicatedTrainer's arguments that need neither a cluster nor devices.

    Raises:
      ValueError, TypeError: as ReplicatedTrainer documents.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {list(ALGORITHMS)}")
    if isinstance(bcast_period, bool) or not isinstance(bcast_period, int) or bcast_period < 0:
        raise ValueError(
            f"bcast_period must be an int >= 0 (0: never re-broadcast), got {bcast_period!r}"
        )
    check_flag(average, "average")
    check_update_options(accumulate_steps, on_nonfinite, compression)


def split_powersgd(allreduce_options):
    """(the all-reduce's options, the PowerSGD or None): PowerSGD is the trainer's part.

    `compression=` takes the all-reduce's wire formats ("fp16", "bf16") and
    a tfreduce.PowerSGD, which the trainer runs around the all-reduce.
    """
    options = dict(allreduce_options)
    if isinstance(options.get("compression"), PowerSGD):
        return options, options.pop("compression")
    return options, None


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """The trainer's settings that shape a step's graph.

    Attributes:
      loss_fn: fn(y_true, y_pred) -> per-example losses.
      class_indices: bool, the loss takes class indices (whole numbers).
      average: bool, the all-reduce averages (True) or sums the gradients.
      total_towers: int T, the towers of all workers.
      devices: list of K canonical device names, this worker's towers.
      algorithm: str, a name in tfreduce.ALGORITHMS (the local one in a cluster).
      allreduce_options: dict passed to tfreduce.allreduce_grads; in a cluster
        pack_bytes and compression go to allreduce_grads_multiworker, the
        rest to its local algorithm.
      cluster: the started tfreduce.Cluster, or None in a single process.
      accumulate_steps: int M >= 1, steps per update (gradient accumulation).
      on_nonfinite: "raise" or "skip", what a step with NaN or Inf
        gradients does.
      powersgd: a tfreduce.PowerSGD compressing the all-reduce, or None.
    """

    loss_fn: Callable
    class_indices: bool
    average: bool
    total_towers: int
    devices: list
    algorithm: str
    allreduce_options: dict
    cluster: object
    accumulate_steps: int = 1
    on_nonfinite: str = "raise"
    powersgd: object = None

    @property
    def multiworker(self):
        """bool: the all-reduces cross workers; loss and counts are then summed over all."""
        return self.cluster is not None

    def describe(self):
        """The settings that shape the collectives, as text the workers compare."""
        options = ", ".join(
            f"{name}={value!r}" if isinstance(value, (bool, int, float, str, list, tuple))
            or value is None else f"{name}={type(value).__name__}"
            for name, value in sorted(self.allreduce_options.items()))
        return (f"algorithm={self.algorithm}, average={self.average}, "
                f"accumulate_steps={self.accumulate_steps}, on_nonfinite={self.on_nonfinite}, "
                f"powersgd={self.powersgd!r}, options: {options}")

    def check(self):
        """Checks the all-reduce options now, as the first step would build them.

        Raises:
          TypeError, ValueError: an option the algorithm does not take, or a
            bad value (pack_bytes, groups that do not fit K, NCCL on CPUs).
        """
        options = dict(self.allreduce_options)
        check_pack_bytes(options.pop("pack_bytes", None))
        as_compressor(options.pop("compression", None))
        if self.cluster is not None:
            options = check_local_options(options)
        else:
            check_flag(options.pop("sparse_as_dense", False), "sparse_as_dense")
            topology = options.pop("topology", None)
            check_auto_options(self.algorithm, topology, options, len(self.devices))
            if topology is not None:
                return  # the plan's stage is built at the first step
        algorithm = self.algorithm
        if algorithm == "auto":
            algorithm = choose_algorithm(self.devices)
        make_stage(algorithm, options).bind(self.devices)

    def allreduce(self, all_grads, average):
        """The trainer's all-reduce: within this process, or across the cluster.

        Args:
          all_grads: K x N list of tensors, all_grads[k][n] on devices[k].
          average: bool, mean instead of sum (over the towers of all workers).

        Returns:
          K x N list, out[k][n] the sum (or mean) over towers, on devices[k].
        """
        if self.cluster is None:
            return allreduce_grads(
                all_grads,
                self.devices,
                average=average,
                algorithm=self.algorithm,
                **self.allreduce_options,
            )
        local_options = dict(self.allreduce_options)
        pack_bytes = local_options.pop("pack_bytes", CROSS_WORKER_PACK_BYTES)
        # Compressed across workers, where the bytes cross the network.
        compression = local_options.pop("compression", None)
        return allreduce_grads_multiworker(
            all_grads,
            self.devices,
            average=average,
            cluster=self.cluster,
            local_algorithm=self.algorithm,
            local_options=local_options,
            pack_bytes=pack_bytes,
            compression=compression,
        )
