"""deterministic=True: the same bits for any number of towers, algorithm and pack size.

The runs that turn determinism on (a process-wide TF setting) happen in
tests/workers/determinism_worker.py, in a process of their own.
"""

import functools
import json
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfreduce
from helpers import CPU_DEVICES
from tfreduce.algorithms.tree import tree_sum, tree_tower_counts
from tfreduce.trainer.determinism import check_deterministic

WORKER = Path(__file__).parent / "workers" / "determinism_worker.py"


def run_worker(*args, timeout=600):
    done = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_tree_adds_adjacent_pairs_and_carries_an_odd_one_up():
    # Values whose sum's bits depend on the order: 1e8 + 1 - 1e8 is 0 or 1 in float32.
    values = [np.float32(v) for v in (1e8, 1.0, -1e8, 1.0, 3.0)]
    got = tree_sum([tf.constant(v) for v in values]).numpy()
    want = ((values[0] + values[1]) + (values[2] + values[3])) + values[4]
    assert got.tobytes() == np.float32(want).tobytes() and got == 3.0
    assert functools.reduce(np.add, values) == 4.0  # left to right: other bits
    only = tf.constant([2.5])
    assert tree_sum([only]) is only


@pytest.mark.parametrize("leaves, counts", [(8, [1, 2, 4, 8]), (12, [3, 6, 12]), (1, [1]),
                                            (6, [3, 6]), (5, [5])])
def test_towers_hold_whole_subtrees_for_these_counts(leaves, counts):
    assert tree_tower_counts(leaves) == counts


@pytest.mark.slow
@pytest.mark.parametrize("tower_counts, cases", [((1, 2, 4), 22), ((8,), 8)],
                         ids=["k-1-2-4", "k-8"])
def test_every_algorithm_and_pack_size_sums_in_the_tree_for_any_k(tower_counts, cases):
    # The worker checks each result against the tree summed in NumPy, bit for bit.
    hashes = run_worker("--reductions", ",".join(map(str, tower_counts)))["reductions"]
    # Every algorithm (no hierarchical one at K=1), unpacked and packed.
    assert len(hashes) == cases and len(set(hashes.values())) == len(tower_counts)
    for k in tower_counts:  # one hash per K: K copies of the sums
        mine = {h for case, h in hashes.items() if case.startswith(f"K={k} ")}
        assert len(mine) == 1, (k, mine)


def train_hashes(cases, steps=30, micro_batches=8, *options):
    """The worker's (hash, drift) of each [K, algorithm, pack_bytes(, micro_batches)] case
    after the steps, in one process (a case's own micro-batch count before the default)."""
    cases = [case[:3] + [steps] + (case[3:] or [micro_batches]) for case in cases]
    runs = run_worker("--train", json.dumps(cases), *options)
    return [(run["hash"], run["drift"]) for run in runs["train"]]


@pytest.mark.slow
def test_a_model_of_a_dict_of_inputs_trains_to_the_same_bits_for_any_k():
    # The micro-batches cut every leaf of the inputs alike.
    runs = train_hashes([[1, "flat", None], [8, "ring", 65536]], 10, 8, "--dict")
    assert len({h for h, _ in runs}) == 1 and all(drift == 0.0 for _, drift in runs), runs


@pytest.mark.slow
def test_towers_compiled_with_xla_train_to_the_same_bits_for_any_k():
    # Each micro-batch's pass is one XLA cluster of one shape, on whichever tower holds it.
    runs = train_hashes([[1, "flat", None], [4, "hierarchical", 65536]], 10, 8, "--jit")
    assert len({h for h, _ in runs}) == 1 and all(drift == 0.0 for _, drift in runs), runs
    plain = train_hashes([[1, "flat", None]], 10, 8)
    assert plain[0][0] != runs[0][0]  # XLA's fused kernels round otherwise: other bits


# A small CNN with BatchNormalization and Dropout, 30 steps of Adam; each
# test's cases together hold every K up to 4, every algorithm and both
# kinds of packing (K = 8 trains in the ZeRO test below).
@pytest.mark.slow
@pytest.mark.parametrize("cases, other_tree", [
    ([[1, "flat", None], [2, "hierarchical", 65536], [4, "ring", None]], True),
    ([[2, "flat", None], [2, "collective", 65536], [4, "hierarchical", None]], False),
], ids=["each-k", "each-algorithm"])
def test_a_cnn_with_batchnorm_and_dropout_trains_to_the_same_bits_for_any_k(cases, other_tree):
    # 4 micro-batches are another tree: another order of the sums, other bits.
    runs = train_hashes(cases + ([cases[0] + [4]] if other_tree else []))
    if other_tree:
        *runs, (other, _) = runs
        assert other != runs[0][0]
    assert len({h for h, _ in runs}) == 1, list(zip(cases, runs))
    assert all(drift == 0.0 for _, drift in runs)  # the replicas are equal too


@pytest.mark.slow
def test_a_run_saved_at_one_k_resumes_at_another_with_the_same_bits(tmp_path):
    runs = run_worker("--resume", str(tmp_path / "ckpt"))["resume"]
    assert set(runs) == {"uninterrupted", "resumed at K=1", "resumed at K=4"}
    assert len({run["hash"] for run in runs.values()}) == 1, runs
    assert all(run["drift"] == 0.0 for run in runs.values())


@pytest.mark.slow
def test_zero_stages_save_the_same_bits_as_stage_0_for_any_k(tmp_path):
    # The checkpoint holds weights and Adam's slots in one layout for any K and stage.
    cases = [[2, "ring", None, 30, 8, 0], [4, "flat", 65536, 30, 8, 1],
             [8, "hierarchical", None, 30, 8, 2]]
    cases = [case + [str(tmp_path / f"run{i}")] for i, case in enumerate(cases)]
    runs = run_worker("--train", json.dumps(cases))["train"]
    assert len({run["saved"] for run in runs}) == 1, runs
    assert all(run["drift"] == 0.0 for run in runs)


@pytest.mark.slow
def test_two_workers_of_two_devices_train_to_the_bits_of_one_process():
    from test_multiworker import launch_workers
    code, out, err, _ = launch_workers("determinism_worker.py", "--train",
                                       json.dumps([[2, "ring", 65536, 30, 8]]))
    assert code == 0, err[-3000:]
    runs = [json.loads(line[line.index("{"):])["train"][0] for line in out.splitlines()
            if '"train"' in line]
    # One line per worker, each of a cluster of two: each trained on half the batch.
    assert [run["workers"] for run in runs] == [2, 2]
    (alone,) = train_hashes([[4, "flat", None]])
    assert runs[0]["hash"] == runs[1]["hash"] == alone[0]
    assert runs[0]["drift"] == 0.0


@pytest.mark.slow
def test_ten_runs_give_the_same_bits():
    # Two processes of five runs each, at once (the machine has two cores).
    cases = json.dumps([[2, "ring", 65536, 30, 4]] * 5)
    started = [subprocess.Popen([sys.executable, str(WORKER), "--train", cases],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(2)]
    runs = []
    for process in started:
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-3000:]
        runs += json.loads(out.splitlines()[-1])["train"]
    assert len(runs) == 10 and len({run["hash"] for run in runs}) == 1


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(algorithm="nccl"), ValueError,
     "deterministic=True sums in a fixed tree of tf.add ops; NCCL's all-reduce is one op"),
    (dict(algorithm="ring", compression="fp16"), ValueError,
     "deterministic=True with compression='fp16': each tower's partial sum would be rounded"),
    (dict(topology="dgx1-v100"), ValueError,
     "deterministic=True with topology='dgx1-v100': a plan picks the algorithm"),
    (dict(algorithm="ring", deterministic=1), TypeError,
     "deterministic must be True or False, got int 1"),
])
def test_a_deterministic_reduction_refuses_what_breaks_the_order(kwargs, error, message):
    kwargs.setdefault("deterministic", True)
    with pytest.raises(error, match=message):
        tfreduce.Reduction(**kwargs)


def model():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def make(devices, **kwargs):
    return tfreduce.ReplicatedTrainer(model, "mse", lambda: keras.optimizers.SGD(0.1),
                                      devices=devices, algorithm="flat", **kwargs)


@pytest.mark.parametrize("devices, kwargs, error, message", [
    (CPU_DEVICES[:3], dict(deterministic=True), ValueError,
     r"deterministic=True with 3 towers and micro_batches=8: each tower must hold a power of "
     r"two of the micro-batches \(a whole subtree of the sum\), so the towers can be "
     r"\[1, 2, 4, 8\]"),
    (CPU_DEVICES[:4], dict(deterministic=True, micro_batches=6), ValueError,
     r"towers can be \[3, 6\]"),
    (CPU_DEVICES[:2], dict(micro_batches=8), TypeError,
     "micro_batches=8 splits the batch of a deterministic step: pass deterministic=True too"),
    (CPU_DEVICES[:2], dict(deterministic=True, micro_batches=2.0), TypeError,
     "micro_batches must be an int, got float 2.0"),
    (CPU_DEVICES[:2], dict(deterministic=True, micro_batches=0), ValueError,
     "micro_batches must be >= 1, got 0"),
    (CPU_DEVICES[:2], dict(deterministic=True, accumulate_steps=2), ValueError,
     "deterministic=True with accumulate_steps=2: those sums are not in the fixed tree yet"),
    (CPU_DEVICES[:2], dict(deterministic=True, powersgd=tfreduce.PowerSGD()), ValueError,
     r"deterministic=True with powersgd=.*PowerSGD"),
])
def test_a_deterministic_trainer_refuses_what_it_cannot_keep_in_the_tree(devices, kwargs, error,
                                                                          message):
    # Refused before any process-wide setting changes.
    with pytest.raises(error, match=message):
        make(devices, **kwargs)


def test_each_worker_must_hold_a_subtree():
    # 2 workers x 3 towers: 6 towers hold 2 of 12 micro-batches each, but a
    # worker's 3 towers are no node of the tree.
    check_deterministic(12, 6, 6, 1, None)  # one process of 6 towers: fine
    with pytest.raises(ValueError, match="deterministic=True with 3 towers per worker: each "
                                         "worker's towers must be a whole subtree of the sum"):
        check_deterministic(12, 6, 3, 1, None)
