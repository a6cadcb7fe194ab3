"""Helpers shared by the tests: device names, K x N inputs, runners, NumPy reference.

conftest.py configures the 8 logical CPU devices before TensorFlow starts;
test modules import what they use from here.
"""

import importlib.util
import itertools
import os

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

NUM_CPUS = 8

#: The image-classification example, which tests import and run.
EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "image_classification.py")

CPU_DEVICES = [f"/device:CPU:{k}" for k in range(NUM_CPUS)]
GPU_DEVICES = [f"/device:GPU:{k}" for k in range(NUM_CPUS)]


def placeholders(devices, specs, dtype=tf.float32):
    """K x N placeholders in the current graph, row k on devices[k].

    specs: list of N shapes (all of ``dtype``) or of (shape, dtype) pairs.
    """
    specs = [s if len(s) == 2 and isinstance(s[1], tf.DType) else (s, dtype) for s in specs]
    out = []
    for k, d in enumerate(devices):
        with tf.device(d):
            out.append([tf.compat.v1.placeholder(t, shape, name=f"t{k}_g{n}")
                        for n, (shape, t) in enumerate(specs)])
    return out


def build_graph(num_towers, shapes, devices=None, dtype=tf.float32):
    """A v1 Graph with K x N placeholders on "/gpu:k": (graph, grads, devices)."""
    devices = devices or GPU_DEVICES[:num_towers]
    graph = tf.Graph()
    with graph.as_default():
        grads = placeholders(devices, shapes, dtype)
    return graph, grads, devices


def v1_session_config():
    """A tf.compat.v1 ConfigProto with the same 8 CPU devices."""
    return tf.compat.v1.ConfigProto(device_count={"CPU": NUM_CPUS})


def place(arrays, devices):
    """K x N numpy arrays -> K x N constants, row k created on devices[k]."""
    out = []
    for row, d in zip(arrays, devices):
        with tf.device(d):
            out.append([None if a is None else tf.constant(a) for a in row])
    return out


def run_in_function(build, arrays, devices):
    """Builds ``build(grads)`` inside a tf.function on K x N inputs and runs it.

    Returns (values, devices): K x N numpy results and the K x N devices of
    the ops that produced them inside the function graph.
    """
    @tf.function(autograph=False)
    def step(*flat):
        it = iter(flat)
        grads = [[None if a is None else next(it) for a in row] for row in arrays]
        grads = [[None if g is None else _on(g, devices[k]) for g in row]
                 for k, row in enumerate(grads)]
        out = build(grads)
        return out

    flat = [tf.constant(a) for row in arrays for a in row if a is not None]
    concrete = step.get_concrete_function(*flat)
    graph_devices = _output_devices(concrete.graph, concrete.structured_outputs)
    values = step(*flat)
    return _numpy(values), graph_devices


def run_in_session(build, arrays, devices):
    """Builds ``build(grads)`` in a tf.compat.v1.Graph and runs it in a Session."""
    graph = tf.Graph()
    with graph.as_default():
        grads = place(arrays, devices)
        out = build(grads)
        graph_devices = [[_producer(t) for t in row] for row in out]
        with tf.compat.v1.Session(graph=graph, config=v1_session_config()) as sess:
            values = sess.run(_fetchable(out))
    return _numpy(values), graph_devices


class SlicesValue:
    """The numpy value of a tf.IndexedSlices, from either runner."""

    def __init__(self, values, indices, dense_shape):
        self.values, self.indices, self.dense_shape = values, indices, dense_shape

    def dense(self):
        out = np.zeros(self.dense_shape, self.values.dtype)
        np.add.at(out, self.indices, self.values)
        return out


def _on(t, device):
    with tf.device(device):
        return tf.identity(t)


def _producer(t):
    if t is None:
        return None
    if isinstance(t, tf.IndexedSlices):
        t = t.values
    return t.op.device


def _output_devices(graph, outputs):
    # tf.function adds an Identity without a device after each output; the
    # op the reduction placed is its input.
    def dev(t):
        if t is None:
            return None
        if isinstance(t, tf.IndexedSlices):
            t = t.values
        op = t.op
        while op.type == "Identity" and not op.device and op.inputs:
            op = op.inputs[0].op
        return op.device
    return [[dev(t) for t in row] for row in outputs]


def _fetchable(out):
    return [[t for t in row] for row in out]


def _numpy(values):
    def conv(v):
        if v is None:
            return None
        if isinstance(v, tf.IndexedSlices):
            return SlicesValue(v.values.numpy(), v.indices.numpy(),
                               None if v.dense_shape is None else v.dense_shape.numpy())
        if hasattr(v, "indices"):  # a Session's IndexedSlicesValue
            return SlicesValue(v.values, v.indices, v.dense_shape)
        return v.numpy() if hasattr(v, "numpy") else np.asarray(v)
    return [[conv(v) for v in row] for row in values]


def alive(pid):
    """True if the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: it vanished while being read
        return False


def thread_count():
    """The number of threads of this process (Linux's /proc)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))


def expected(grads, average):
    """NumPy reference: sum (in float32 for half types), mean = sum * (1/K)."""
    num_towers = len(grads)
    out = []
    for n in range(len(grads[0])):
        dtype = grads[0][n].dtype
        acc = np.dtype(np.float32) if dtype in (np.float16, ml_dtypes.bfloat16) else dtype
        total = np.sum([g[n].astype(acc) for g in grads], axis=0, dtype=acc)
        if average:
            total = total * acc.type(1.0 / num_towers)
        out.append(np.asarray(total).astype(dtype))
    return out


def check(values, devices, grads, average, placed_on):
    want = expected(grads, average)
    for k, row in enumerate(values):
        for n, got in enumerate(row):
            assert got.dtype == want[n].dtype, (k, n)
            assert got.shape == want[n].shape, (k, n)
            np.testing.assert_array_equal(got, want[n], err_msg=f"tower {k} variable {n}")
            assert devices[k][n].endswith(placed_on[k]), (k, n, devices[k][n])


def load_script(path, name):
    """Imports the Python file at path (a script, not on sys.path) as module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def scalars(logdir, prefix=""):
    """tag -> the values, in order, of the TensorBoard scalars whose tag starts with prefix.

    prefix: a str or a tuple of them. Every event file under logdir (a
    run's subdirectories included)."""
    values = {}
    for root, _, files in sorted(os.walk(logdir)):
        for name in sorted(f for f in files if ".tfevents." in f):
            for event in tf.compat.v1.train.summary_iterator(os.path.join(root, name)):
                for value in event.summary.value:
                    if value.tag.startswith(prefix):
                        values.setdefault(value.tag, []).append(
                            float(tf.make_ndarray(value.tensor)))
    return values


def covering_array(features, strength, start):
    """Cases, `start` first then greedily, in which any `strength` features take
    every combination of their values together."""
    def combinations(case):
        return {(axes, tuple(case[i] for i in axes))
                for axes in itertools.combinations(range(len(features)), strength)}

    every = list(itertools.product(*features))
    missing = set().union(*map(combinations, every))
    cases = []
    for case in start:
        cases.append(case)
        missing -= combinations(case)
    while missing:
        case = max(every, key=lambda c: len(combinations(c) & missing))
        cases.append(case)
        missing -= combinations(case)
    return cases


#: The runners of a reduction by name, for grids that choose them case by case.
RUNNERS = {"function": run_in_function, "session": run_in_session}


def covering(strength=2, slow=None, **factors):
    """``pytest.mark.parametrize`` over a covering array of the factors.

    Every combination of the values of any `strength` factors appears in
    some case (``covering_array``, the same cases on every run): a grid of
    2 runners x 4 algorithms x 6 K x 2 x 2 takes 26 cases instead of 192,
    and still runs every algorithm at every K and in each runner. A bug
    that needs three factors together is not certain to be met; where one
    matters, pass strength=3 or give that triple its own test.

    Args:
      strength: int >= 2, how many factors each combination covers.
      slow: None, or a function of a case's values (a dict) that is true
        for the cases to mark `slow`.
      **factors: name -> list of values (any objects), in the test's
        argument order.

    Returns:
      the parametrize mark; case ids join the values' str with "-".
    """
    names = list(factors)
    indices = covering_array([range(len(factors[n])) for n in names], strength, [])
    cases = []
    for index in indices:
        row = [factors[n][i] for n, i in zip(names, index)]
        marks = [pytest.mark.slow] if slow is not None and slow(dict(zip(names, row))) else []
        cases.append(pytest.param(*row, marks=marks, id="-".join(str(v) for v in row)))
    return pytest.mark.parametrize(names, cases)
