"""The MPI transport: eager cross-process collectives over MPI (mpi4py), for CPU workers.

Between processes, TF's collectives go over its gRPC runtime: on one
2-core host a 4 KiB all-reduce of two processes costs about 2 ms there and
0.01-0.1 ms over Open MPI's shared memory, and a 32 MiB one about 3x MPI's
time (``tfreduce-bench --mode crossprocess``). Horovod ran its CPU
collectives over MPI or Gloo for the same reason. With this transport
(``Cluster(..., transport="mpi")``, or ``"auto"`` when ``mpirun`` started
the processes and mpi4py imports) the Horovod-style calls move their
bytes over MPI, and so does the agreement that precedes each eager one
(``consistency.check_same_call``): eagerly every collective; inside a
traced function (a ``tf.function``, ``model.fit``'s step) the dense
all-reduces and broadcasts, each one op that waits in MPI
(``tfreduce.tensorflow.mpi_calls``). ``ReplicatedTrainer``'s reduction,
compressed calls and ``tf.IndexedSlices`` stay on TF's runtime.

Every collective is MPI-3's non-blocking one (``Iallreduce``,
``Iallgatherv``, ``Ibcast``, ``Ireduce_scatter``, ``Ialltoallv``) polled to
completion, one at a time per process, so that when the watchdog names a
frozen or lost peer (``abort``) the waiting call raises
``tf.errors.UnavailableError`` with the watchdog's message, as an aborted
TF collective does, instead of waiting in MPI for good. A process whose
transport was aborted ends the job at exit (``MPI_Abort``: mpirun stops
every process, a frozen one included) rather than finalize MPI, which
would wait for the frozen peer and progress the abandoned request.

Sources: MPI 3.1 (non-blocking collectives, section 5.12); Horovod's MPI
controller and operations (horovod/common/ops/mpi_operations.cc), which
carry the same collectives; mpi4py's buffer interface.
"""

import atexit
import itertools
import math
import sys

import numpy as np

from tfreduce.basis.tf_config import mpirun_size

__all__ = ["ALIGNMENT", "TRANSPORTS", "MpiTransport", "check_transport", "empty",
           "open_transport"]

#: Bytes every array this transport returns is aligned to (TensorFlow's EIGEN_MAX_ALIGN_BYTES).
ALIGNMENT = 64
#: The values of ``Cluster(transport=)``.
TRANSPORTS = ("auto", "grpc", "mpi")
# dtype -> the dtype its reductions are formed in over MPI (MPI has no
# 16-bit float nor bool sum; 8- and 16-bit integers as the TF wire widens
# them, which is exact: a sum modulo 2**8 taken in int32 and cast back).
_REDUCED_IN = {"float16": "float32", "bfloat16": "float32", "bool": "int32", "int8": "int32",
               "uint8": "int32", "int16": "int32", "uint16": "int32"}


def check_transport(transport):
    """transport, checked: one of TRANSPORTS.

    Raises:
      ValueError: any other value (named).
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(map(repr, TRANSPORTS))}, "
                         f"got {transport!r}")
    return transport


def open_transport(transport, rank, num_workers, describe):
    """The MpiTransport a started cluster uses, or None for TF's gRPC alone.

    Args:
      transport: one of TRANSPORTS. "auto": MPI when mpirun started exactly
        `num_workers` processes and mpi4py imports, else gRPC.
      rank: int, this process's rank in the cluster (its MPI rank in the
        transport's communicator, whatever mpirun's order).
      num_workers: int W.
      describe: function rank -> str, for messages.

    Raises:
      ValueError: transport="mpi" and mpi4py does not import, the process
        was not started by mpirun, or mpirun's process count is not W.
    """
    if transport == "grpc" or num_workers < 2:
        return None
    size = mpirun_size()
    # Checked before mpi4py's MPI is imported: importing it starts MPI (outside
    # mpirun, as a singleton that spawns a daemon).
    if size != num_workers:
        if transport == "auto":
            return None
        started = "was not started by mpirun" if size is None else f"is one of {size}"
        raise ValueError(f"{describe(rank)}: transport='mpi' needs the cluster's "
                         f"{num_workers} processes started by mpirun (mpirun -np "
                         f"{num_workers} ...); this process {started}")
    try:
        from mpi4py import MPI
    except ImportError as error:
        if transport == "mpi":
            raise ValueError(f"{describe(rank)}: transport='mpi' needs mpi4py, which does not "
                             f"import ({error}): pip install 'tfreduce[mpi]'") from None
        return None
    return MpiTransport(MPI.COMM_WORLD.Split(0, rank), MPI)


class MpiTransport:
    """One communicator of the cluster's processes, ranked as the cluster ranks them.

    Its calls take and return NumPy arrays, block until done (polling, see
    the module docstring) and must be made by every process in the same
    order, one at a time (the eager calls' agreement sees to it, and a
    graph's build order: ``tfreduce.tensorflow.mpi_calls.in_graph_order``).

    Args:
      comm: an mpi4py intracommunicator of W processes, rank r the
        cluster's rank r.
      mpi: the ``mpi4py.MPI`` module.
    """

    def __init__(self, comm, mpi):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._mpi = mpi
        self._ops = {"sum": mpi.SUM, "min": mpi.MIN, "max": mpi.MAX, "product": mpi.PROD}
        self.aborted = None
        self._abandoned = []  # requests left pending by an abort: their buffers stay alive

    def abort(self, message):
        """Makes the call waiting now (and every later one) raise UnavailableError(message).

        From then on the process ends the job when it exits (MPI_Abort with
        code 1) instead of finalizing MPI."""
        if self.aborted is None:
            atexit.register(self._end_job)  # before mpi4py's finalize (atexit runs LIFO)
        self.aborted = message

    def _end_job(self):
        sys.stdout.flush()
        sys.stderr.flush()
        self._mpi.COMM_WORLD.Abort(1)

    def _wait(self, request):
        test = request.Test
        while not test():
            if self.aborted is not None:
                self._abandoned.append(request)
                break
        self._check()

    def _check(self):
        if self.aborted is not None:
            import tensorflow as tf  # the class an aborted collective raises
            raise tf.errors.UnavailableError(None, None, self.aborted)

    def allreduce(self, array, op="sum", scale=None):
        """Every process's `array` reduced elementwise: a new array of its shape and dtype.

        Args:
          array: np.ndarray, the same shape and dtype on every process.
          op: "sum", "min", "max" or "product".
          scale: None, or a float the result is multiplied by in the dtype
            the reduction was formed in (a mean: 1 / W), before its cast back.
        """
        self._check()
        given = np.asarray(array, order="C")
        wire = given.astype(_REDUCED_IN.get(given.dtype.name, given.dtype), copy=False)
        received = empty(wire.shape, wire.dtype)
        self._wait(self.comm.Iallreduce(wire, received, op=self._ops[op]))
        return _finish(received, scale, given.dtype)

    def allgather(self, array, counts=None):
        """Every process's rows of `array` joined along axis 0 in rank order.

        Args:
          array: np.ndarray of rank >= 1, one dtype and one shape past axis
            0 on every process.
          counts: None (every process has array's rows), or W ints, process
            r's rows.

        Returns:
          np.ndarray [sum of counts, ...].
        """
        self._check()
        given = np.asarray(array, order="C")
        counts = [len(given)] * self.size if counts is None else [int(c) for c in counts]
        row = given.itemsize * math.prod(given.shape[1:])
        out = empty((sum(counts),) + given.shape[1:], given.dtype)
        sizes = [c * row for c in counts]
        self._wait(self.comm.Iallgatherv(_bytes(given), [_bytes(out), sizes, _offsets(sizes),
                                                         self._mpi.BYTE]))
        return out

    def broadcast(self, array, root):
        """The root's `array` (np.ndarray, one shape and dtype on every process), on every process."""
        self._check()
        out = empty(np.shape(array), np.asarray(array).dtype)
        out[...] = array
        self._wait(self.comm.Ibcast(_bytes(out), root=root))
        return out

    def reduce_scatter(self, array, counts, op="sum", scale=None):
        """Process r's rows of the elementwise reduction of `array`: rows counts[r] in rank order.

        Args:
          array: np.ndarray [sum(counts), ...], one shape on every process.
          counts: W ints, the rows each process keeps.
          op, scale: as allreduce's.
        """
        self._check()
        given = np.asarray(array, order="C")
        wire = given.astype(_REDUCED_IN.get(given.dtype.name, given.dtype), copy=False)
        row = math.prod(given.shape[1:])
        out = empty((int(counts[self.rank]),) + given.shape[1:], wire.dtype)
        self._wait(self.comm.Ireduce_scatter(wire, out, [int(c) * row for c in counts],
                                             op=self._ops[op]))
        return _finish(out, scale, given.dtype)

    def alltoall(self, array, send_counts, receive_counts):
        """Rows send_counts[r] of `array` (in order) to process r; the rows received, in rank order.

        Args:
          array: np.ndarray [sum(send_counts), ...].
          send_counts: W ints; receive_counts: W ints, process r's rows
            for this one.
        """
        self._check()
        given = np.asarray(array, order="C")
        row = given.itemsize * math.prod(given.shape[1:])
        out = empty((sum(int(c) for c in receive_counts),) + given.shape[1:], given.dtype)
        send = [int(c) * row for c in send_counts]
        receive = [int(c) * row for c in receive_counts]
        byte = self._mpi.BYTE
        self._wait(self.comm.Ialltoallv([_bytes(given), send, _offsets(send), byte],
                                        [_bytes(out), receive, _offsets(receive), byte]))
        return out


def empty(shape, dtype):
    """A new C-contiguous array whose memory starts on a multiple of ALIGNMENT bytes.

    TensorFlow takes such memory as a tensor's without a copy (DLPack);
    NumPy's own allocations are 16-byte aligned."""
    dtype = np.dtype(dtype)
    shape = (int(shape),) if np.isscalar(shape) else tuple(shape)
    count = math.prod(shape)  # math's: a tenth of NumPy's cost
    raw = np.empty(count * dtype.itemsize + ALIGNMENT, np.uint8)
    skip = -raw.ctypes.data % ALIGNMENT
    return raw[skip:skip + count * dtype.itemsize].view(dtype).reshape(shape)


def _finish(received, scale, dtype):
    if scale is not None:
        received *= received.dtype.type(scale)
    if received.dtype == dtype:
        return received
    out = empty(received.shape, dtype)
    out[...] = received
    return out


def _bytes(array):
    """A C-contiguous array's memory as uint8 (what MPI moves for gathers and broadcasts)."""
    return array.reshape(-1).view(np.uint8)


def _offsets(sizes):
    return list(itertools.accumulate(sizes[:-1], initial=0))
