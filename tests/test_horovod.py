"""tfreduce.tensorflow and tfreduce.tensorflow.keras: a Horovod script on 2 processes.

Two processes on 127.0.0.1 (tfreduce-launch --workers 2) run
tests/workers/horovod_worker.py; each feeds its half of every global batch,
and the result must equal one process fitting the whole global batches.
"""

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from test_multiworker import launch_workers

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import horovod_worker  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("horovod")
    # Many scenarios in one run (two TF start-ups instead of a dozen): on a
    # loaded 2-core machine it takes minutes.
    code, _, err, _ = launch_workers("horovod_worker.py", "--out", out, timeout=400)
    errors = [line for line in err.splitlines() if "Error" in line or "watchdog" in line]
    assert code == 0, "\n".join(errors[-20:]) + "\n" + err[-3000:]
    return [np.load(out / f"rank{r}.npz") for r in range(2)]


pytestmark = pytest.mark.slow

# float16 compute: 2 processes on half batches against one on whole ones
# (observed below 1e-4 on this machine; 10x margin).
MIXED_ATOL = 1e-3


def test_process_functions_and_the_error_before_init(ranks):
    for r, got in enumerate(ranks):
        assert got["process"].tolist() == [r, 2, r, 2, 0, 1]
        assert str(got["init_error"]) == ("tfreduce.tensorflow.init() has not been called: "
                                          "call it first, before building the model")


def test_collectives_hold_no_thread_per_call(ranks):
    # TF's per-op timeout starts a thread per op execution that sleeps for the
    # whole timeout (300 s): 4 per eager call, 2 per call in a tf.function.
    # Horovod's test suite (thousands of calls) aborted with no thread left.
    for r, got in enumerate(ranks):
        before, after = got["threads"].tolist()
        assert after - before <= 10, f"rank {r}: {before} threads, then {after} after 80 calls"


def test_collectives_equal_numpy(ranks):
    x = [np.array([1.0, 2.0]) * (r + 1) for r in range(2)]
    for r, got in enumerate(ranks):
        np.testing.assert_array_equal(got["mean"], (x[0] + x[1]) / 2)
        np.testing.assert_array_equal(got["sum"], x[0] + x[1])
        np.testing.assert_array_equal(got["scaled"], x[0] + x[1])
        # 16 bits on the wire, prescaled by 1/2 before the cast: rank 0's
        # 70000 is beyond float16 (65504) and the sum 80000 too, the mean fits.
        half = [np.float16(35000.0), np.float16(0.5)], [np.float16(5000.0), np.float16(1.5)]
        np.testing.assert_array_equal(got["fp16"], np.add(*half))
        assert got["fp16"].tolist() == [40000.0, 2.0]
        np.testing.assert_array_equal(got["grouped0"], x[0] + x[1])
        assert got["grouped1"].tolist() == [[1]] and got["grouped1"].dtype == np.int64
        np.testing.assert_array_equal(got["gather"], [[0, 0], [1, 1], [1, 1]])
        # Means of [1, 2, 3] + 2r over 2 processes: rows 0-1 to rank 0, row 2 to rank 1.
        np.testing.assert_array_equal(got["scatter"], [[[2.0], [3.0]], [[4.0]]][r])
        # 16 bits on the wire: 1000.5 + 2001 = 3001.5 rounds to 3002 in
        # float16; then x 0.5 (postscale).
        assert got["scatter_fp16"].tolist() == [[[1501.0], [4.5]], [[10.5]]][r]
        # Rank 0 sends [10] to itself and [20, 30] to rank 1; rank 1 sends
        # nothing to rank 0 and [11] to itself.
        assert got["alltoall"].tolist() == [[[10.0]], [[20.0], [30.0], [11.0]]][r]
        assert got["received"].tolist() == [[1, 0], [2, 1]][r]
        assert got["alltoall_again"].tolist() == [[[10.0], [11.0]], [[20.0], [30.0]]][r]
        # Without splits each rank's rows are halved: rank 0 sends [0] and
        # [1], rank 1 [10, 11] and [12, 13].
        assert got["alltoall_even"].tolist() == [[0, 10, 11], [1, 12, 13]][r]
        assert re.fullmatch(
            r"SplitsError: alltoall without splits sends each of the 2 processes the same "
            r"number of rows, so each process's rows must be a multiple of 2: worker 0 "
            r"\(127\.0\.0\.1:\d+\) has 3 \(give splits=\)", str(got["alltoall_uneven"]))
        assert got["after_uneven"].tolist() == [[0, 10], [1, 11]][r]
        np.testing.assert_array_equal(got["bcast"], [20.0, 40.0])
        np.testing.assert_array_equal(got["bcast_var"], [1.0, 6.0])
        assert got["bcast_small0"].tolist() == [201, 1] and got["bcast_small0"].dtype == np.uint8
        assert got["bcast_small1"].tolist() == [-4] and got["bcast_small1"].dtype == np.int16
        assert got["bcast_small2"].tolist() == [True] and got["bcast_small3"].tolist() == [1.5]
        assert str(got["root_error"]) == ("broadcast: root_rank must be an int in 0..1 (the "
                                          "ranks of the 2 processes), got 2")


def test_horovods_semantics_beyond_float_sums(ranks):
    for r, got in enumerate(ranks):
        # 8-bit sums wrap as in the narrow type (220 -> -36); an integer
        # mean is that sum times 1/2 in float64, truncated (Horovod's).
        assert got["int8_sum"].tolist() == [-36, 36, 8] and got["int8_sum"].dtype == np.int8
        assert got["int8_mean"].tolist() == [-18, 18, 4]
        assert got["uint8_mean"].tolist() == [22, 1, 7] and got["uint8_mean"].dtype == np.uint8
        # 0.75 scales integers: [3, 6] + [4.5 -> 4, 6.75 -> 6].
        assert got["int_prescale"].tolist() == [7, 12]
        assert got["int_postscale"].tolist() == [2, 4]  # [10, 17] x 0.5 / 2, truncated
        assert got["float_Min"].tolist() == [1.0, 2.0, -2.0]
        assert got["float_Max"].tolist() == [3.0, 5.0, 4.0]
        assert got["float_Product"].tolist() == [3.0, 10.0, -8.0]
        assert got["int16_Max"].tolist() == [3, -5] and got["int16_Max"].dtype == np.int16
        assert got["slices"].tolist() == [[1.0, 2.0], [2.0, 4.0]]
        assert got["slices_rows"].tolist() == [0, 1] and bool(got["slices_shape"])
        # 8-bit rows cross widened (200 stays 200); a sparse integer mean is
        # Horovod's true division: float32 for 8-bit values, float64 for 64-bit.
        assert got["slices_uint8_sum"].tolist() == [[100, 7], [200, 14]]
        assert got["slices_uint8_sum"].dtype == np.uint8
        assert got["slices_uint8_mean"].tolist() == [[50.0, 3.5], [100.0, 7.0]]
        assert got["slices_uint8_mean"].dtype == np.float32
        assert got["slices_int64_mean"].tolist() == [[1.5, -2.5], [1.5, -2.5]]
        assert got["slices_int64_mean"].dtype == np.float64
        assert str(got["slices_min_error"]) == (
            "allreduce: op='min' does not reduce tf.IndexedSlices, only Sum and Average do "
            "(densify them first: tf.convert_to_tensor, or sparse_as_dense=True)")
        assert got["gather_bool"].tolist() == [True, False]
        assert got["gather_int8"].tolist() == [-3, 4] and got["gather_int8"].dtype == np.int8
        assert got["gather_bfloat16"].tolist() == [1.5, 2.5]
        assert got["bcast_int16"].tolist() == [4, 1] and got["bcast_int16"].dtype == np.int16
        assert str(got["objects"]) == "[{'rank': 0, 's': 'xxx'}, {'rank': 1, 's': 'xxxx'}]"
        assert str(got["object"]) == "{'rank': 1, 'l': [0, 1, 2]}"
        assert got["rank_ops"].tolist() == [r, 2, r, 2]
        assert got["broadcast_"].tolist() == [1.0]
        # Means of [3, 5, 7] and [6, 10, 14], truncated: [4, 7] to rank 0, [10] to rank 1.
        assert got["scatter_int_mean"].tolist() == [[[4], [7]], [[10]]][r]
        assert got["alltoall_int8"].tolist() == [[1, 2], [2, 3]][r]


def test_gradients_through_the_collectives_follow_horovods_rules(ranks):
    # The upstream gradient is r + 1 on rank r: 1 and 2.
    for r, got in enumerate(ranks):
        def rows(*values):
            return [[v, v] for v in values]
        assert got["grad_allreduce"].tolist() == rows(1.5, 1.5, 1.5)  # the mean of 1 and 2
        assert got["grad_sum"].tolist() == rows(3.0, 3.0, 3.0)
        assert got["grad_grouped"].tolist() == rows(3.0, 3.0, 3.0)  # 2x, through 2 * x
        # This rank's rows of the mean; rank 0 gathered 2 rows, rank 1 one.
        assert got["grad_allgather"].tolist() == [rows(1.5, 1.5, 0.0), rows(1.5, 0.0, 0.0)][r]
        # The mean on the root (rank 1), zeros elsewhere.
        assert got["grad_broadcast"].tolist() == [rows(0.0, 0.0, 0.0), rows(1.5, 1.5, 1.5)][r]
        # Rows 0-1 went to rank 0 (upstream 1), row 2 to rank 1 (upstream 2).
        assert got["grad_reducescatter"].tolist() == rows(1.0, 1.0, 2.0)
        # Rank 0 sent row 0 to itself and rows 1-2 to rank 1; rank 1 all to rank 0.
        assert got["grad_alltoall"].tolist() == [rows(1.0, 2.0, 2.0), rows(1.0, 1.0, 1.0)][r]
        assert got["gathered_again"].tolist() == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]] * 2


def test_calls_that_differ_between_ranks_raise_on_every_rank_and_the_next_call_works(ranks):
    # Checked before any data moves, so TF's runtime is never aborted.
    calls = {"shape": ["allreduce (average, none, 1.0, 1.0) of float32 [3]",
                       "allreduce (average, none, 1.0, 1.0) of float32 [4]"],
             "names": ["allreduce 'a' (average, none, 1.0, 1.0) of float32 [2]",
                       "allreduce 'b' (average, none, 1.0, 1.0) of float32 [2]"],
             "root": ["broadcast (0) of float32 [2]", "broadcast (1) of float32 [2]"],
             "kind": ["allreduce (average, none, 1.0, 1.0) of float32 [2]",
                      "allgather of float32 [None]"]}
    for r, got in enumerate(ranks):
        for name, (call0, call1) in calls.items():
            assert re.fullmatch(
                rf"CallMismatchError: worker {r} \(127\.0\.0\.1:\d+\): the processes made "
                r"different collective calls, which must be the same, in the same order, on "
                rf"every process: worker 0 \(127\.0\.0\.1:\d+\): {re.escape(call0)}; "
                rf"worker 1 \(127\.0\.0\.1:\d+\): {re.escape(call1)} \(when a process's data "
                r"ends before the others', it calls join\(\), which lets them finish\)",
                str(got[f"mismatch_{name}"])), str(got[f"mismatch_{name}"])
            assert got[f"after_{name}"].tolist() == [1.0, 1.0], name
        # In a TF1 session too, the next call pairs up (and then an eager one).
        assert "CallMismatchError: worker " in str(got["v1_graph_error"])
        assert ("allreduce (average, none, 1.0, 1.0) of float32 [3] in op 'hvd_in_session'; "
                "worker 1 " in str(got["v1_graph_error"]))
        assert got["v1_graph_next"].tolist() == [1.0, 1.0]
        assert got["after_v1_graph"].tolist() == [1.0, 1.0]


def test_join_lets_the_rank_with_more_batches_finish_with_zeros_from_the_joined_one(ranks):
    # Rank 0 has 3 batches, rank 1 has 2; after join(), rank 1 adds zeros
    # (a mean still divides by size, as in Horovod).
    for r, got in enumerate(ranks):
        assert [got[f"join/sum{s}"].tolist() for s in range(2)] == [[2.0, 10.0], [4.0, 10.0]]
        assert [got[f"join/int_mean{s}"].tolist() for s in range(2)] == [[5, 0], [6, 0]]
        assert [got[f"join/grad{s}"].tolist() for s in range(2)] == [[2.0, 2.0], [3.0, 2.0]]
        assert got["join/last"] == 0 and got["join/last_again"] == 1
        assert re.fullmatch(
            rf"CallMismatchError: worker {r} \(127\.0\.0\.1:\d+\): the call of the workers still "
            r"working, allgather of float32 \[None\], cannot go on while these wait in join\(\) "
            r"\(their data ended\): worker 1 \(127\.0\.0\.1:\d+\)\. After a join\(\), the others "
            r"may only all-reduce dense tensors with op Sum or Average, eagerly \(as in Horovod\); "
            r"call join\(\) after the last other call", str(got["join/refused"])), got["join/refused"]
        assert got["join/after"].tolist() == [1.0, 1.0]
    assert ranks[0]["join/sum2"].tolist() == [3.0, 0.0]
    assert ranks[0]["join/int_mean2"].tolist() == [3, 0]  # (7 + 0) // 2
    assert ranks[0]["join/grad2"].tolist() == [2.0, 0.0]
    assert "join/sum2" not in ranks[1] and ranks[1]["join/sum_again"].tolist() == [7.0]


def test_tf1_graphs_run_the_collectives_in_each_processs_own_session(ranks):
    for r, got in enumerate(ranks):
        assert got["v1/allreduce"].tolist() == [3.0, 4.0]
        assert got["v1/allreduce_uint8"].tolist() == [3, 5]  # (5 + 6) / 2 truncated
        assert got["v1/allreduce_uint8"].dtype == np.uint8
        assert got["v1/allgather"].tolist() == [[0], [1], [1]]
        assert got["v1/broadcast"].tolist() == [2.0, 5.0]
        assert got["v1/reducescatter"].tolist() == [[[1.5], [2.5]], [[3.5]]][r]
        assert got["v1/alltoall"].tolist() == [[[10.0]], [[20.0], [30.0], [11.0]]][r]
        assert got["v1/alltoall_received"].tolist() == [[1, 0], [2, 1]][r]
        # Horovod's gradient rules, as eagerly: this rank's rows of the mean
        # of 2 x the gathered [[1, 2], [2, 2]]; the 3s sent back.
        assert got["v1/grad_allgather"].tolist() == [[[2.0, 4.0]], [[4.0, 4.0]]][r]
        assert got["v1/grad_alltoall"].tolist() == [[[3.0]] * 3, [[3.0]]][r]
        assert got["v1/grad_alltoall_even"].tolist() == [[[3.0]] * 2, [[3.0]] * 4][r]
        assert got["v1/grad_broadcast"].tolist() == [[[2.0, 2.0]], [[0.0, 0.0]]][r]
        assert str(got["v1/allgather_object"]) == "[{'rank': 0}, {'rank': 1}]"
        assert str(got["v1/broadcast_object"]) == "('r', 1)"
        assert got["v1/variable"].tolist() == [1.0, 4.0]  # rank 1's
        side = str(got["v1/side_by_side"])
        assert side == str([np.array([3.0], np.float32), np.array([30.0], np.float32)]) or (
            "the processes made different collective calls" in side
            and "in op 'hvd_in_session_" in side), side
        # rank 0's: v was rank 1's already, w is a reference variable.
        assert got["v1/global_v"].tolist() == [1.0, 4.0] and got["v1/global_w"].tolist() == [0.0]


@pytest.mark.parametrize("name", ["partial_tape", "partial_fit"])
def test_local_layers_learn_from_their_own_rank_and_the_rest_is_reduced(ranks, name):
    # Variables 0-1 (the first Dense layer) are local: each rank's own
    # batches make them differ; variables 2-3 are reduced: identical.
    for i in (0, 1):
        assert not np.array_equal(ranks[0][f"{name}/{i}"], ranks[1][f"{name}/{i}"]), i
    for i in (2, 3):
        np.testing.assert_array_equal(ranks[0][f"{name}/{i}"], ranks[1][f"{name}/{i}"])
    if name == "partial_tape":
        for got in ranks:  # this rank's own gradient / 2 processes, exactly
            assert float(got["local_grad_error"]) == 0.0


def assert_equal_to_one_process(ranks, name, want, atol):
    weights, losses = want
    for r, got in enumerate(ranks):
        for i, w in enumerate(weights):
            np.testing.assert_allclose(got[f"{name}/{i}"], w, rtol=0, atol=atol,
                                       err_msg=f"rank {r} variable {i}")
            # The replicas are identical: drift 0.
            np.testing.assert_array_equal(got[f"{name}/{i}"], ranks[0][f"{name}/{i}"])
        np.testing.assert_allclose(got[f"{name}/loss"], losses, rtol=1e-5)
        np.testing.assert_array_equal(got[f"{name}/loss"], ranks[0][f"{name}/loss"])


def test_fit_on_two_processes_equals_one_process_on_the_global_batches(ranks):
    assert str(ranks[0]["fit/class"]) == "Adam"
    assert_equal_to_one_process(ranks, "fit", horovod_worker.reference(), atol=1e-6)


def test_fit_with_fp16_compression_stays_within_16_bit_bounds(ranks):
    weights, _ = horovod_worker.reference()
    for r, got in enumerate(ranks):
        for i, w in enumerate(weights):
            np.testing.assert_allclose(got[f"fp16/{i}"], w, rtol=0, atol=5e-3)
            assert np.abs(got[f"fp16/{i}"] - got[f"fit/{i}"]).max() > 0  # it did compress
            np.testing.assert_array_equal(got[f"fp16/{i}"], ranks[0][f"fp16/{i}"])


def test_backward_passes_per_step_equals_the_full_batch(ranks):
    assert_equal_to_one_process(ranks, "passes4", horovod_worker.reference(micro=4),
                                atol=1e-6)


@pytest.mark.parametrize("name, dtype, atol", [("syncbn", "float32", 1e-6),
                                               ("float64", "float64", 1e-12)])
def test_sync_batch_norm_equals_batch_norm_on_the_global_batches(ranks, name, dtype, atol):
    # The moving statistics too: every process normalises with the global
    # batch's mean and variance, as one process on the whole batch does.
    want = horovod_worker.reference(dtype=dtype, batch_norm=True)
    assert len(want[0]) == 8  # Dense (2), BatchNorm (4: gamma, beta, moving mean, variance), Dense (2)
    assert_equal_to_one_process(ranks, name, want, atol=atol)


def test_mixed_float16_decides_on_the_reduced_gradients_the_same_on_every_process(ranks):
    # The LossScaleOptimizer is inside DistributedOptimizer: one scale, the
    # same decisions on both processes; float16 compute, so within its bounds.
    weights, _ = horovod_worker.reference(mixed=True)
    assert str(ranks[0]["mixed/class"]) == "LossScaleOptimizer"
    assert float(ranks[0]["mixed/scale"]) == float(ranks[1]["mixed/scale"])
    for r, got in enumerate(ranks):
        for i, w in enumerate(weights):
            np.testing.assert_allclose(got[f"mixed/{i}"], w, rtol=0, atol=MIXED_ATOL,
                                       err_msg=f"rank {r} variable {i}")
            np.testing.assert_array_equal(got[f"mixed/{i}"], ranks[0][f"mixed/{i}"])


def test_distributed_gradient_tape_equals_one_process(ranks):
    want = horovod_worker.reference_tape()
    for r, got in enumerate(ranks):
        for i, w in enumerate(want):
            np.testing.assert_allclose(got[f"tape/{i}"], w, rtol=0, atol=1e-6)
            np.testing.assert_array_equal(got[f"tape/{i}"], ranks[0][f"tape/{i}"])


def test_processes_that_built_other_models_fail_fast_on_every_process(tmp_path):
    # Under Horovod they would hang in the first collective.
    code, _, err, _ = launch_workers("horovod_worker.py", "--out", tmp_path,
                                     "--rank1-hidden", 9)
    assert code != 0
    for rank in range(2):
        assert re.search(
            rf"\[worker {rank}\] ValueError: worker {rank} \(127\.0\.0\.1:\d+\): the workers "
            r"do not run the same training: variable 0 differs: worker 0 \(127\.0\.0\.1:\d+\) "
            r"has \S+ \(6, 8\) float32; worker 1 \(127\.0\.0\.1:\d+\) has \S+ \(6, 9\) float32",
            err), err[-3000:]
    assert "WorkerLostError" not in err  # not a collective's timeout


def test_a_run_killed_and_restarted_from_rank_0s_backup_ends_like_an_undisturbed_one(tmp_path):
    # BackupAndRestore and ModelCheckpoint on rank 0 only, as Horovod scripts
    # do; rank 0 dies after epoch 2 (index 1) and the launcher restarts both.
    # The restored epoch and state reach rank 1 with the first broadcast, and
    # DistributedBatches reshuffle from fit's epoch: the resumed run sees the
    # same batches as the undisturbed one.
    runs = {}
    for name, extra in [("undisturbed", []), ("killed", ["--kill-at-epoch", 1])]:
        (tmp_path / name).mkdir()
        code, out, err, _ = launch_workers("horovod_worker.py", "--out", tmp_path / name,
                                           "--resumable", *extra, launcher=["--restarts", "1"])
        assert code == 0, err[-3000:]
        runs[name] = [np.load(tmp_path / name / f"rank{r}.npz") for r in range(2)]
        if extra:
            assert "restart" in (out + err).lower(), (out + err)[-2000:]
    for r in range(2):
        assert runs["undisturbed"][r]["epochs"].tolist() == [0, 1, 2, 3, 4]
        assert runs["killed"][r]["epochs"].tolist() == [2, 3, 4]  # resumed at epoch 3
        for key in runs["undisturbed"][r].files:
            if key.startswith("weights/"):
                np.testing.assert_array_equal(runs["killed"][r][key],
                                              runs["undisturbed"][r][key], err_msg=key)
    assert sorted(p.name for p in (tmp_path / "killed").glob("epoch*.weights.h5")) == [
        f"epoch{e}.weights.h5" for e in range(1, 6)]


def test_a_call_that_fails_on_one_process_alone_shifts_no_pairing():
    # Each of onesided_worker's cases: rank 1 alone makes a bad call (its own
    # check raises), then both all-reduce r+1 and 10(r+1): 3 and 30 on both,
    # never another call's sum; then both make the call and only rank 1's is
    # bad: rank 1 raises its error, rank 0 a CallMismatchError naming it,
    # and the next sums are right again.
    code, out, err, _ = launch_workers("onesided_worker.py", launcher=("--stall-seconds", "5"),
                                       timeout=300)
    assert code == 0, err[-3000:]
    records = [json.loads(line.split("] ", 1)[1]) for line in out.splitlines()
               if "] {" in line]
    names = {r["case"] for r in records} - {"join"}
    assert len(names) == 12, sorted(names)
    for record in records:
        rank, case = record["rank"], record["case"]
        if case == "join":  # rank 1 failed a call, then joined: rank 0's sum is its own
            assert record.get("sum", 1.0) == 1.0, record
            continue
        sums = [[s.get("returned"), s.get("raised")] for s in record["alone_sums"]
                + record["both_sums"]]
        assert sums == [[3.0, None], [30.0, None]] * 2, (case, rank, sums)
        if rank == 1:
            # Its own error, twice (an object's address aside).
            assert record["alone"]["raised"] == record["both"]["raised"], case
            assert record["alone"]["raised"] in ("ValueError", "TypeError"), record
        else:
            assert record["both"]["raised"] == "CallMismatchError", record
            assert re.fullmatch(
                r"worker 0 \(127\.0\.0\.1:\d+\): the same collective call failed its own checks "
                r"on another process, so it raises on every process \(nothing was sent; the "
                r"next call pairs as before\): worker 1 \(127\.0\.0\.1:\d+\): failed \w+: "
                r"(ValueError|TypeError): .*", record["both"]["message"]), record
