"""Property-based tests (hypothesis) of the K x N contract.

1. Every CPU algorithm equals NumPy on every device, exactly, for random K
   (1-8 logical CPU devices), N (1-6), shapes (scalar to 4-D, zero-size
   included), dtypes, gradients that are None on every tower,
   ``tf.IndexedSlices`` on every tower (one dense_shape, different row
   counts), ``groups`` partitions, ``pack_bytes``, sum and mean.
2. Malformed input raises ValueError or TypeError, before anything is
   built, with a message that names the tower, the variable or the bad
   argument.

Values are multiples of 1/4 in [-16, 16] (integers for int32), so every sum
over 8 towers is exact in the accumulation dtype and any summation order
gives the NumPy value of ``helpers.expected``. Each example builds one
``tf.function`` and runs it once. The examples are derandomized (the same
ones on every run) and nothing is written to a ``.hypothesis`` database.
The whole file takes about 75 s on 2 CPU cores.

Zero-size gradients through "collective" run in a subprocess only
(``test_collective_zero_size_in_subprocess``): a crash inside TensorFlow's
collective runtime must fail that test, not kill the whole pytest process.
"""

import dataclasses
import itertools
import os
import re
import signal
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tfreduce
import zygote
from helpers import CPU_DEVICES, NUM_CPUS, SlicesValue, expected, run_in_function

# Hypothesis caches the constants it reads in local source files under
# ./.hypothesis; keep them out of the checkout.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY",
                      os.path.join(tempfile.gettempdir(), "tfreduce-hypothesis"))

CPU_ALGORITHMS = ["flat", "hierarchical", "ring", "collective"]
ALL_ALGORITHMS = ["auto", "flat", "hierarchical", "ring", "collective", "nccl"]
DTYPES = {
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float32": np.float32,
    "float64": np.float64,
    "int32": np.int32,
}
FLOATS = ["float16", "bfloat16", "float32", "float64"]
HALF = ("float16", "bfloat16")
MAX_VARS = 6
# Collective ops wait for their peers: a reduction that loses one fails
# after this many seconds instead of hanging the test run.
COLLECTIVE_TIMEOUT = 60

NUMERIC_EXAMPLES = {"flat": 100, "hierarchical": 100, "ring": 80, "collective": 70}
COLLECTIVE_ZERO_SIZE_EXAMPLES = 30
SUBPROCESS_TIMEOUT = 240
ERROR_EXAMPLES = 100


def property_settings(max_examples):
    # derandomize: CI sees the same examples on every run; database=None: no
    # .hypothesis directory in the checkout.
    return settings(max_examples=max_examples, deadline=None, derandomize=True,
                    database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


# ----------------------------------------------------------------------------
# Inputs: one variable, one call.


@dataclasses.dataclass(frozen=True)
class Var:
    """One variable's gradients on the K towers.

    kind: "dense", "none" (None on every tower) or "slices" (tf.IndexedSlices).
    shape: the gradient's shape (dense) or dense_shape (slices).
    rows: slices only, the number of rows tower k holds (K ints).
    index_dtype: slices only, the dtype of the indices.
    """

    kind: str
    dtype: str
    shape: tuple = ()
    rows: tuple = ()
    index_dtype: str = "int64"

    def dense_shape(self):
        return self.shape

    def tower_shape(self, k):
        """The shape of tower k's tensor (of its values, for slices)."""
        return self.shape if self.kind == "dense" else (self.rows[k],) + tuple(self.shape[1:])


@dataclasses.dataclass(frozen=True)
class Case:
    """One call of ``allreduce_grads`` on K logical CPU devices."""

    algorithm: str
    num_towers: int
    average: bool
    pack_bytes: object
    groups: object
    variables: tuple
    seed: int

    def options(self):
        options = {"pack_bytes": self.pack_bytes}
        if self.algorithm == "hierarchical":
            options["groups"] = self.groups
        if self.algorithm == "collective":
            options["timeout"] = COLLECTIVE_TIMEOUT
        return options


def shapes(min_dim, max_rank=4):
    return st.lists(st.integers(min_dim, 4), max_size=max_rank).map(tuple)


@st.composite
def partitions(draw, num_devices):
    """A random partition of range(K) into non-empty groups, in random order."""
    order = draw(st.permutations(range(num_devices)))
    cuts = sorted(draw(st.sets(st.integers(1, num_devices - 1))) if num_devices > 1 else [])
    bounds = [0] + cuts + [num_devices]
    return [list(order[a:b]) for a, b in itertools.pairwise(bounds)]


@st.composite
def variables(draw, num_towers, dtypes, min_dim, kinds=("dense", "none", "slices")):
    kind = draw(st.sampled_from(kinds))
    dtype = draw(st.sampled_from(dtypes))
    if kind == "dense":
        return Var(kind, dtype, draw(shapes(min_dim)))
    if kind == "none":
        return Var(kind, dtype)
    # Rows touched per tower differ; indices may repeat (duplicates add up).
    dense_shape = (draw(st.integers(1, 6)),) + draw(shapes(min_dim, max_rank=2))
    rows = tuple(draw(st.lists(st.integers(min_dim, 4), min_size=num_towers,
                               max_size=num_towers)))
    index_dtype = draw(st.sampled_from(["int64", "int32"]))
    return Var(kind, dtype, dense_shape, rows, index_dtype)


@st.composite
def cases(draw, algorithm, zero_size="allow"):
    """A Case; zero_size is "allow", "forbid" (no tensor of size 0 anywhere)
    or "require" (at least one dense gradient of size 0)."""
    num_towers = draw(st.integers(1, NUM_CPUS))
    average = draw(st.booleans())
    dtypes = FLOATS if average else FLOATS + ["int32"]  # mean of int32 is a TypeError
    min_dim = 1 if zero_size == "forbid" else 0
    max_vars = MAX_VARS - 1 if zero_size == "require" else MAX_VARS
    vs = draw(st.lists(variables(num_towers, dtypes, min_dim), min_size=1, max_size=max_vars))
    if zero_size == "require":
        shape = list(draw(shapes(0).filter(len)))
        shape[draw(st.integers(0, len(shape) - 1))] = 0
        empty = Var("dense", draw(st.sampled_from(dtypes)), tuple(shape))
        vs.insert(draw(st.integers(0, len(vs))), empty)
    pack_bytes = draw(st.one_of(st.none(), st.integers(0, 96), st.just(1 << 20)))
    groups = None
    if algorithm == "hierarchical":
        groups = draw(st.one_of(st.none(), partitions(num_towers)))
    seed = draw(st.integers(0, 2**16))
    return Case(algorithm, num_towers, average, pack_bytes, groups, tuple(vs), seed)


def make_arrays(case):
    """K x N numpy values (None for "none") and K x N indices (slices only)."""
    rng = np.random.default_rng(case.seed)
    num_towers, num_vars = case.num_towers, len(case.variables)
    values = [[None] * num_vars for _ in range(num_towers)]
    indices = [[None] * num_vars for _ in range(num_towers)]
    for n, var in enumerate(case.variables):
        if var.kind == "none":
            continue
        for k in range(num_towers):
            v = rng.integers(-64, 65, size=var.tower_shape(k))
            v = v if var.dtype == "int32" else v / 4.0
            values[k][n] = np.asarray(v).astype(DTYPES[var.dtype])
            if var.kind == "slices":
                indices[k][n] = rng.integers(0, var.shape[0], size=var.rows[k]).astype(
                    var.index_dtype)
    return values, indices


# ----------------------------------------------------------------------------
# Property 1: exact per-device values.


def gathered_reference(var, n, values, indices, average):
    """The gathered IndexedSlices every algorithm returns: the K towers' rows
    concatenated in tower order, the values scaled by 1/K (in float32 for
    half types) when averaging."""
    num_towers = len(values)
    vals = np.concatenate([values[k][n] for k in range(num_towers)], axis=0)
    idx = np.concatenate([indices[k][n].astype(np.int64) for k in range(num_towers)])
    if average:
        acc = np.dtype(np.float32) if var.dtype in HALF else np.dtype(DTYPES[var.dtype])
        vals = (vals.astype(acc) * acc.type(1.0 / num_towers)).astype(DTYPES[var.dtype])
    return vals, idx


def run_case(case):
    """Builds the reduction of ``case`` in one tf.function, runs it, checks it."""
    devices = CPU_DEVICES[:case.num_towers]
    values, indices = make_arrays(case)

    def build(grads):
        grads = [list(row) for row in grads]
        for k, row in enumerate(grads):
            for n, var in enumerate(case.variables):
                if var.kind == "slices":
                    with tf.device(devices[k]):
                        grads[k][n] = tf.IndexedSlices(
                            row[n], tf.constant(indices[k][n]),
                            tf.constant(var.shape, tf.int64))
        out = tfreduce.allreduce_grads(grads, devices, average=case.average,
                                       algorithm=case.algorithm, **case.options())
        assert type(out) is list and all(type(row) is list for row in out), (
            f"the output must be a list of K lists, got {out!r}")
        return out

    got, placed = run_in_function(build, values, devices)
    check_case(case, got, placed, values, indices, devices)


def check_case(case, got, placed, values, indices, devices):
    num_towers, num_vars = case.num_towers, len(case.variables)
    assert len(got) == num_towers, f"{len(got)} output rows for {num_towers} towers"
    dense = [n for n, var in enumerate(case.variables) if var.kind == "dense"]
    want = dict(zip(dense, expected([[row[n] for n in dense] for row in values], case.average)
                    if dense else []))
    for k in range(num_towers):
        assert len(got[k]) == num_vars, f"tower {k}: {len(got[k])} outputs for {num_vars}"
        for n, var in enumerate(case.variables):
            where = f"tower {k} variable {n} ({var})"
            out = got[k][n]
            if var.kind == "none":
                assert out is None, f"{where}: None on every tower must stay None, got {out!r}"
                continue
            assert out is not None, f"{where}: got None"
            assert placed[k][n] and placed[k][n].endswith(devices[k]), (
                f"{where}: placed on {placed[k][n]!r}, not {devices[k]!r}")
            if var.kind == "dense":
                assert not isinstance(out, SlicesValue), f"{where}: a dense gradient came " \
                                                         f"back as IndexedSlices"
                out = np.asarray(out)
                assert out.dtype == want[n].dtype, f"{where}: dtype {out.dtype}"
                assert out.shape == want[n].shape, f"{where}: shape {out.shape}"
                np.testing.assert_array_equal(out, want[n], err_msg=where)
            else:
                assert isinstance(out, SlicesValue), (
                    f"{where}: IndexedSlices must come back as IndexedSlices, got "
                    f"{type(out).__name__}")
                vals, idx = gathered_reference(var, n, values, indices, case.average)
                assert out.values.dtype == vals.dtype, f"{where}: dtype {out.values.dtype}"
                assert out.values.shape == vals.shape, f"{where}: values shape " \
                                                       f"{out.values.shape}, want {vals.shape}"
                np.testing.assert_array_equal(out.values, vals, err_msg=where + " values")
                np.testing.assert_array_equal(out.indices, idx, err_msg=where + " indices")
                np.testing.assert_array_equal(out.dense_shape, var.shape,
                                              err_msg=where + " dense_shape")


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", CPU_ALGORITHMS)
def test_every_algorithm_equals_numpy_on_every_device(algorithm):
    # Zero-size gradients through "collective" are the subprocess test's:
    # a crash there must not take this process down.
    zero_size = "forbid" if algorithm == "collective" else "allow"

    @property_settings(NUMERIC_EXAMPLES[algorithm])
    @given(case=cases(algorithm, zero_size))
    def prop(case):
        run_case(case)

    prop()


def collective_zero_size_property():
    """Run by the subprocess: "collective" with at least one zero-size gradient.

    Prints each example before running it, so the parent can name the
    example a crash happened on (a crash leaves hypothesis no time to).
    """
    @property_settings(COLLECTIVE_ZERO_SIZE_EXAMPLES)
    @given(case=cases("collective", "require"))
    def prop(case):
        print(f"EXAMPLE {case!r}", flush=True)
        run_case(case)

    prop()


@pytest.mark.slow
def test_collective_zero_size_in_subprocess():
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    script = (f"import sys; sys.path.insert(0, {tests_dir!r}); "
              f"import conftest, test_properties; "
              f"test_properties.collective_zero_size_property()")
    try:
        proc = zygote.run([sys.executable, "-c", script], timeout=SUBPROCESS_TIMEOUT,
                          cwd=os.path.dirname(tests_dir))
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        pytest.fail(f"no result after {SUBPROCESS_TIMEOUT} s, last example: "
                    f"{last_example(stdout)}")
    if proc.returncode == 0:
        return
    output = proc.stdout + proc.stderr
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        pytest.fail(f"the process died of {name} on {last_example(proc.stdout)}"
                    f"\n--- output (tail) ---\n{output[-3000:]}")
    pytest.fail(f"exit status {proc.returncode}\n--- output (tail) ---\n{output[-6000:]}")


def last_example(stdout):
    examples = re.findall(r"^EXAMPLE (.*)$", stdout, re.MULTILINE)
    return examples[-1] if examples else "(none printed)"


# ----------------------------------------------------------------------------
# Property 2: malformed input.


@dataclasses.dataclass(frozen=True)
class BadCall:
    """A valid K x N call on "/gpu:k" strings with one fault injected.

    fault: the kind, then what it changes (see ``bad_calls``).
    direct: call ``allreduce_grads_<algorithm>`` instead of the dispatcher.
    """

    fault: tuple
    algorithm: str
    direct: bool
    num_towers: int
    variables: tuple


# Shape faults, by what tower k's copy of the variable is: another dense
# shape; IndexedSlices with another row shape; IndexedSlices with the same
# rows but another dense_shape; dense on one tower, IndexedSlices of another
# dense shape on the other.
SHAPE_FAULTS = ["shape_dense", "shape_slices_rows", "shape_slices_dense_shape",
                "shape_dense_vs_slices"]
FAULTS = (["ragged_n", "none_on_some_towers"] + SHAPE_FAULTS
          + ["dtype", "devices_count", "duplicate_devices", "groups", "average"])
DEVICE_SPELLINGS = ["/gpu:{}", "GPU:{}", "/device:GPU:{}", "gpu:{}", "/GPU:{}"]
BAD_AVERAGES = ["no", "yes", "", "False", 0, 1, 2, 0.5, None, [], [True]]


@st.composite
def bad_groups(draw, num_devices):
    groups = draw(partitions(num_devices))
    how = draw(st.sampled_from(["duplicate", "missing", "out_of_range", "empty_group",
                                "not_an_int", "not_a_list"]))
    g = draw(st.integers(0, len(groups) - 1))
    if how == "duplicate":
        groups[g].append(draw(st.sampled_from(sorted(i for grp in groups for i in grp))))
    elif how == "missing":
        groups[g].pop(draw(st.integers(0, len(groups[g]) - 1)))
        groups = [grp for grp in groups if grp]
    elif how == "out_of_range":
        groups[g].append(draw(st.sampled_from([num_devices, num_devices + 1, -1, 100])))
    elif how == "empty_group":
        groups.insert(draw(st.integers(0, len(groups))), [])
    elif how == "not_an_int":
        i = draw(st.integers(0, len(groups[g]) - 1))
        index = groups[g][i]
        groups[g][i] = draw(st.sampled_from([str(index), float(index), None, True]))
    else:
        groups[g] = draw(st.sampled_from([groups[g][0], "0", None]))
    return how, groups


@st.composite
def shape_fault(draw, fault, num_towers):
    """(variable n as tower 0 has it, tower k's copy of another dense shape)."""
    def var(kinds, dtypes=FLOATS):
        return variables(num_towers, dtypes, 0, kinds=kinds)

    if fault == "shape_dense_vs_slices":
        kinds = draw(st.sampled_from([("dense", "slices"), ("slices", "dense")]))
    else:
        kinds = ("dense",) * 2 if fault == "shape_dense" else ("slices",) * 2
    base = draw(var(kinds[:1]))
    if fault == "shape_slices_rows":
        other = draw(var(kinds[1:], [base.dtype]).filter(lambda v: v.shape[1:] != base.shape[1:]))
    elif fault == "shape_slices_dense_shape":
        num_rows = draw(st.integers(1, 6).filter(lambda r: r != base.shape[0]))
        other = dataclasses.replace(base, shape=(num_rows,) + base.shape[1:])
    else:
        other = draw(var(kinds[1:], [base.dtype]).filter(
            lambda v: v.dense_shape() != base.dense_shape()))
    return base, other


@st.composite
def bad_calls(draw, fault):
    min_towers = 1 if fault in ("devices_count", "groups", "average") else 2
    num_towers = draw(st.integers(min_towers, 6))
    vs = draw(st.lists(variables(num_towers, FLOATS, 0), min_size=1, max_size=4))
    algorithm = "hierarchical" if fault == "groups" else draw(st.sampled_from(ALL_ALGORITHMS))
    direct = algorithm != "auto" and draw(st.booleans())
    n = draw(st.integers(0, len(vs) - 1))
    k = draw(st.integers(0, num_towers - 1))
    if fault in ("none_on_some_towers", "dtype") and vs[n].kind == "none":
        # The fault needs a gradient on some tower.
        vs[n] = draw(variables(num_towers, FLOATS, 0, kinds=("dense", "slices")))
    if fault == "ragged_n":
        detail = (k, draw(st.sampled_from(["drop", "add"])))
    elif fault == "none_on_some_towers":
        towers = draw(st.sets(st.integers(0, num_towers - 1), min_size=1,
                              max_size=num_towers - 1))
        detail = (n, tuple(sorted(towers)))
    elif fault in SHAPE_FAULTS:
        vs[n], other = draw(shape_fault(fault, num_towers))
        detail = (n, k, other)
    elif fault == "dtype":
        detail = (n, k, draw(st.sampled_from([d for d in DTYPES if d != vs[n].dtype])))
    elif fault == "devices_count":
        detail = (draw(st.integers(0, num_towers + 2).filter(lambda c: c != num_towers)),)
    elif fault == "duplicate_devices":
        i, j = sorted(draw(st.lists(st.integers(0, num_towers - 1), min_size=2, max_size=2,
                                    unique=True)))
        detail = (i, j, draw(st.sampled_from(DEVICE_SPELLINGS)))
    elif fault == "groups":
        detail = draw(bad_groups(num_towers))
    else:
        detail = (draw(st.sampled_from(BAD_AVERAGES)),)
    return BadCall((fault,) + detail, algorithm, direct, num_towers, tuple(vs))


def make_tensor(var, k, device):
    """Tower k's gradient of ``var`` (zeros), built on ``device``."""
    if var.kind == "none":
        return None
    dtype = tf.as_dtype(DTYPES[var.dtype])
    with tf.device(device):
        values = tf.zeros(var.tower_shape(k), dtype)
        if var.kind == "dense":
            return values
        return tf.IndexedSlices(values, tf.zeros([var.rows[k]], var.index_dtype),
                                tf.constant(var.shape, tf.int64))


def build_bad_call(bad):
    """The (all_grads, kwargs) of ``bad`` in the current graph, and the
    substrings its error message must hold."""
    fault, detail = bad.fault[0], bad.fault[1:]
    num_towers = bad.num_towers
    devices = [f"/gpu:{k}" for k in range(num_towers)]
    vs = list(bad.variables)
    specs = [[v for v in vs] for _ in range(num_towers)]  # K x N Var
    kwargs = {"devices": devices, "average": False}
    must = []
    if fault == "ragged_n":
        k, how = detail
        if how == "drop":
            specs[k].pop()
        else:
            specs[k].append(Var("dense", "float32", (2,)))
        must = [f"tower {k}"]
    elif fault in SHAPE_FAULTS or fault == "dtype":
        n, k, other = detail
        specs[k][n] = other if fault != "dtype" else dataclasses.replace(vs[n], dtype=other)
        must = [f"variable {n}", f"tower {k}"]
    elif fault == "none_on_some_towers":
        n, towers = detail
        for k in towers:
            specs[k][n] = Var("none", vs[n].dtype)
        must = [f"variable {n}"]
    elif fault == "devices_count":
        count, = detail
        kwargs["devices"] = [f"/gpu:{i}" for i in range(count)]
        must = ["devices", "tower"] if count == 0 else [f"{num_towers} towers",
                                                         f"{count} devices"]
    elif fault == "duplicate_devices":
        i, j, spelling = detail
        kwargs["devices"] = list(devices)
        kwargs["devices"][j] = spelling.format(i)
        must = [f"devices[{i}]", f"devices[{j}]"]
    elif fault == "groups":
        kwargs["groups"] = detail[1]
        must = ["groups"]
    else:
        kwargs["average"] = detail[0]
        must = ["average"]
    all_grads = [[make_tensor(v, k, devices[k]) for v in row] for k, row in enumerate(specs)]
    return all_grads, kwargs, must


def call(bad, all_grads, kwargs):
    if bad.direct:
        return getattr(tfreduce, f"allreduce_grads_{bad.algorithm}")(all_grads, **kwargs)
    return tfreduce.allreduce_grads(all_grads, algorithm=bad.algorithm, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
def test_malformed_input_raises_value_or_type_error(fault):
    @property_settings(ERROR_EXAMPLES)
    @given(bad=bad_calls(fault))
    def prop(bad):
        with tf.Graph().as_default() as graph:
            all_grads, kwargs, must = build_bad_call(bad)
            ops_before = len(graph.get_operations())
            try:
                out = call(bad, all_grads, kwargs)
            except (ValueError, TypeError) as e:
                message = str(e)
            else:
                raise AssertionError(f"no error; returned {out!r}")
            missing = [s for s in must if s not in message]
            assert not missing, f"the message {message!r} does not name {missing}"
            built = [op.name for op in graph.get_operations()[ops_before:]]
            assert not built, f"raised {message!r} after building {len(built)} ops: " \
                              f"{built[:5]}"

    prop()
