"""One entry point that picks an all-reduce algorithm by name (the registry's stages).

``algorithm="auto"`` takes the registry's rule (``choose_algorithm``), or,
given ``topology=``, the candidate the cost model predicts fastest there
(``planner.plan_for``).
"""

from tfreduce.choices import ALGORITHMS
from tfreduce.contract import validate_grads
from tfreduce.frame import run_stages
from tfreduce.planner import check_auto_options, plan_for
from tfreduce.registry import choose_algorithm, frame_options, make_stage

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
      algorithm: a name in ALGORITHMS; "auto" uses ``choose_algorithm``,
        or, with ``topology``, the plan below.
      **options: passed to the algorithm: ``pack_bytes``, ``sparse_as_dense``,
        ``compression`` (all); ``groups`` (hierarchical); ``communication``, ``keys``,
        ``timeout`` (collective). ``topology`` (a tfreduce.Topology, a preset
        name such as "dgx1-v100", or "host"), with "auto" only: the
        algorithm, groups and pack size (unless ``pack_bytes`` is given)
        with the lowest time ``tfreduce.predict`` gives for these gradients
        there (``tfreduce.plan_allreduce``; each call plans anew, building
        every candidate once in a scratch graph: in an eager loop, plan once
        and pass ``plan.kwargs()``).

    Returns:
      list[list[tf.Tensor]], K x N; ``out[k][n]`` is placed on ``devices[k]``.

    Raises:
      ValueError: unknown algorithm, or bad input (see the algorithm);
        topology with a named algorithm, an unknown preset, a topology
        with fewer than K devices, a gradient of unknown shape to plan on.
      TypeError: an option the algorithm does not take (with topology:
        any but the frame's).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"unknown all-reduce algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    topology = options.pop("topology", None)
    check_auto_options(algorithm, topology, options)
    # The input is validated once; a named algorithm checks its options first.
    if algorithm == "auto":
        grads = validate_grads(all_grads, devices)
        plan = None if topology is None else plan_for(grads, topology, average, options)
        if plan is None:
            algorithm = choose_algorithm(grads.devices)
        else:
            algorithm, options = plan.algorithm, {**options, **plan.options}
        stage = make_stage(algorithm, options)
    else:
        stage = make_stage(algorithm, options)
        grads = validate_grads(all_grads, devices)
    return run_stages(grads, [stage], average, **frame_options(options))
