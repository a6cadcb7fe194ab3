"""One entry point that picks an all-reduce algorithm by name."""

from tfreduce.contract import is_gpu, validate_grads
from tfreduce.hierarchical import allreduce_grads_hierarchical
from tfreduce.nccl_ops import allreduce_grads_collective, allreduce_grads_nccl
from tfreduce.replicated import allreduce_grads_flat
from tfreduce.ring import allreduce_grads_ring

__all__ = ["ALGORITHMS", "allreduce_grads", "choose_algorithm"]

_BUILDERS = {
    "flat": allreduce_grads_flat,
    "hierarchical": allreduce_grads_hierarchical,
    "ring": allreduce_grads_ring,
    "nccl": allreduce_grads_nccl,
    "collective": allreduce_grads_collective,
}

#: Names ``allreduce_grads(algorithm=...)`` accepts.
ALGORITHMS = ("auto",) + tuple(_BUILDERS)

_OPTIONS = {
    "flat": {"pack_bytes", "sparse_as_dense"},
    "hierarchical": {"pack_bytes", "sparse_as_dense", "groups"},
    "ring": {"pack_bytes", "sparse_as_dense"},
    "nccl": {"pack_bytes", "sparse_as_dense"},
    "collective": {"pack_bytes", "sparse_as_dense", "communication", "keys", "timeout"},
}


def choose_algorithm(devices):
    """The algorithm ``"auto"`` picks for these (canonical) devices.

    - K == 1: "flat" (an identity per gradient);
    - every device a GPU: "nccl", which uses NVLink/PCIe topology itself
      (tf.distribute's MirroredStrategy makes the same default);
    - otherwise (CPUs, or a mix): "flat". Logical CPU devices share one
      memory, where a reduction costs memory passes, and reducing each
      gradient once on one device makes the fewest (see the benchmark).

    Args:
      devices: list of K canonical device strings.

    Returns:
      str, a name in ALGORITHMS other than "auto".
    """
    if len(devices) > 1 and all(is_gpu(d) for d in devices):
        return "nccl"
    return "flat"


def allreduce_grads(all_grads, devices=None, average=False, algorithm="auto", **options):
    """All-reduces K x N gradients with the named algorithm.

    K x N contract, K=2, N=2, sum::

        [[A, B],      ->   [[A+C, B+D],    # on devices[0]
         [C, D]]            [A+C, B+D]]    # on devices[1]

    Args:
      all_grads: list of K lists of N gradients (``tf.Tensor``,
        ``tf.IndexedSlices`` or None); ``all_grads[k][n]`` from tower k.
      devices: list of K device strings, or None for the tensors' devices.
      average: bool, mean instead of sum.
      algorithm: a name in ALGORITHMS; "auto" uses ``choose_algorithm``.
      **options: passed to the algorithm: ``pack_bytes``, ``sparse_as_dense``
        (all); ``groups`` (hierarchical); ``communication``, ``keys``,
        ``timeout`` (collective).

    Returns:
      list[list[tf.Tensor]], K x N; ``out[k][n]`` is placed on ``devices[k]``.

    Raises:
      ValueError: unknown algorithm, or bad input (see the algorithm).
      TypeError: an option the algorithm does not take.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"unknown all-reduce algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    if algorithm == "auto":
        algorithm = choose_algorithm(validate_grads(all_grads, devices).devices)
    unknown = sorted(set(options) - _OPTIONS[algorithm])
    if unknown:
        raise TypeError(
            f"algorithm {algorithm!r} takes no option {unknown}; it takes "
            f"{sorted(_OPTIONS[algorithm])}")
    return _BUILDERS[algorithm](all_grads, devices=devices, average=average, **options)
