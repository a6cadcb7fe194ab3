"""The reduction ops and process sets a Horovod-style call names, and their checks.

Sources: Horovod's API (horovod.tensorflow: ``hvd.Average``, ``hvd.Sum``,
``hvd.Min``, ``hvd.Max``, ``hvd.Product``, ``hvd.Adasum``; ``average=``,
its deprecated spelling; process sets, ``global_process_set``).
"""

__all__ = ["Adasum", "Average", "Max", "Min", "Product", "ProcessSet", "Sum", "check_op",
           "check_process_set", "global_process_set", "ELEMENTWISE"]

#: op= of a mean over the processes (Horovod's default).
Average = "average"
#: op= of a sum over the processes.
Sum = "sum"
#: op= of the elementwise minimum over the processes.
Min = "min"
#: op= of the elementwise maximum over the processes.
Max = "max"
#: op= of the elementwise product over the processes.
Product = "product"
#: Horovod's Adasum, which tfreduce refuses with a ValueError that names it.
Adasum = "adasum"
_OPS = (Average, Sum, Min, Max, Product)
#: op -> the merge of TF's CollectiveReduceV2, for the ops built one tensor each.
ELEMENTWISE = {Min: "Min", Max: "Max", Product: "Mul"}


class ProcessSet:
    """Horovod's process set; tfreduce has one, every process (``global_process_set``)."""

    def __repr__(self):
        return "global_process_set"


#: The process set of every process, the only one tfreduce knows.
global_process_set = ProcessSet()


def check_op(op, average=None, where="allreduce"):
    """The op of a reduction, from Horovod's ``op`` and its deprecated ``average``.

    Returns:
      Average or Sum.

    Raises:
      ValueError: both given, or an op other than Average and Sum.
    """
    if average is not None:
        if op is not None:
            raise ValueError(f"{where}: pass op= only (average= is Horovod's deprecated "
                             "spelling of op=Average)")
        return Average if average else Sum
    if op is None:
        return Average
    if op not in _OPS:
        raise ValueError(f"{where}: op must be tfreduce.tensorflow.Average, Sum, Min, Max or "
                         f"Product, got {op!r} (Adasum is not supported)")
    return op


def check_process_set(process_set, where):
    """Raises ValueError for a process set other than global_process_set, naming `where`."""
    if process_set is not global_process_set:
        raise ValueError(f"{where}: process_set={process_set!r}: only global_process_set "
                         "(every process) is supported")
