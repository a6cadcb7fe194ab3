"""Each collective's rules, one row per collective: what is checked, and how it is built.

Standard library only (``choices.COLLECTIVES`` names these rows for the
command lines before TensorFlow is imported). ``tfreduce.doors.collectives``
reads a collective's row wherever the collectives differ, so a new
collective is one row here plus its builders: the function that builds one
group's collective from a stage (``collective_build.BUILDERS``) and, where
it needs one, a method of each stage that builds it (docs/architecture.md,
"Adding a collective").
"""

import dataclasses

__all__ = ["CollectiveRule", "COLLECTIVE_RULES", "builds"]


@dataclasses.dataclass(frozen=True)
class CollectiveRule:
    """What one collective takes and returns.

    Attributes:
      shapes: str, what it needs of the towers' tensors: "same" (one shape
        on every tower), "rows" (the axes after the first agree: rows are
        joined) or "root" (only the roots' tensors are read; the other
        towers' rows may be None).
      refuses_scalar: bool, a scalar has no rows to split or join.
      rooted: bool, it takes ``root=``, a tower's position in every group.
      sums: bool, it sums the towers' tensors: ``average=``, wire
        compression and the stage's sum dtypes apply.
      on_root: bool, its result is N tensors on each group's root (not K x N).
      takes_splits: bool, it takes the ``splits=`` of an all-to-all.
      local_step: str or None, across workers the collective each worker's
        own stage builds around the cross-worker op (None: the worker's rows
        are joined on its first device, whatever the algorithm).
      needs: tuple of the collectives its builder composes, or None (it is
        one of the stages' own: a stage lists it in ``collectives``).
    """

    shapes: str
    refuses_scalar: bool
    rooted: bool = False
    sums: bool = False
    on_root: bool = False
    takes_splits: bool = False
    local_step: str = None
    needs: tuple = None


#: The collectives besides all-reduce, by name, in the order of the docs.
COLLECTIVE_RULES = {
    "reduce_scatter": CollectiveRule("same", True, sums=True, local_step="reduce"),
    "all_gather": CollectiveRule("rows", True),
    "broadcast": CollectiveRule("root", False, rooted=True, local_step="broadcast"),
    "reduce": CollectiveRule("same", False, rooted=True, sums=True, on_root=True,
                             local_step="reduce"),
    "all_to_all": CollectiveRule("rows", True, takes_splits=True),
}


def builds(stage, collective):
    """bool: the stage (a Stage class or instance) builds `collective`.

    A stage builds the collectives it lists in ``collectives``, and every
    collective whose rule ``needs`` only those.
    """
    needs = COLLECTIVE_RULES[collective].needs or (collective,)
    return all(name in stage.collectives for name in needs)
