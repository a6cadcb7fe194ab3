"""One entry point that picks an all-reduce algorithm by name (the registry's stages)."""

from tfreduce.choices import ALGORITHMS, DEFAULT_PACK_BYTES
from tfreduce.contract import validate_grads
from tfreduce.frame import run_stages
from tfreduce.registry import choose_algorithm, make_stage

__all__ = ["allreduce_grads"]


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
      **options: passed to the algorithm: ``pack_bytes``, ``sparse_as_dense``,
        ``compression`` (all); ``groups`` (hierarchical); ``communication``, ``keys``,
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
    # The input is validated once; a named algorithm checks its options first.
    if algorithm == "auto":
        grads = validate_grads(all_grads, devices)
        stage = make_stage(choose_algorithm(grads.devices), options)
    else:
        stage = make_stage(algorithm, options)
        grads = validate_grads(all_grads, devices)
    return run_stages(grads, [stage], average,
                      pack_bytes=options.get("pack_bytes", DEFAULT_PACK_BYTES),
                      sparse_as_dense=options.get("sparse_as_dense", False),
                      compression=options.get("compression"))
