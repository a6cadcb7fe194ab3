"""ReplicatedTrainer on Keras 2 (tf_keras) models and optimizers, in a process of its own.

``TF_USE_LEGACY_KERAS=1`` must be set before TensorFlow starts, so the runs
are tests/workers/keras2_worker.py's (one process for all of them): a
Sequential without an Input, a subclassed model and a BatchNormalization
CNN train on 2 towers with their replicas equal, to the weights of one
tower (float32 rounding; the CNN's BatchNormalization normalises each
tower's shard, so it is left out of that comparison), and a run saved and
resumed equals the uninterrupted one, and with jit_compile=True the CNN
trains to the uncompiled weights; ZeRO and mixed float16 are refused
with messages; deterministic=True gives the same bits on 1 and 2 towers; TF
Model Garden's two steps under MirroredStrategy with CrossDeviceOps equal
TF's own ops. Horovod's Keras
API on Keras 2 runs 2 processes of tests/workers/horovod_keras2_worker.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tf_keras")

WORKER = Path(__file__).parent / "workers" / "keras2_worker.py"


@pytest.fixture(scope="module")
def runs():
    done = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("model", ["sequential", "subclassed", "cnn"])
def test_a_tf_keras_model_trains_with_its_replicas_equal_and_resumes_exactly(runs, model):
    got = runs[model]
    assert got["keras2"] and got["steps"] == 8 and got["drift"] == 0.0
    assert got["resumed"] == 0.0  # saved after epoch 1, restored, epoch 2: the same bits
    if model != "cnn":
        assert got["one_device"] < 1e-6
    assert 0 < got["evaluate"]["loss"] < 1.1 and got["predict_shape"] == [64, 3]


@pytest.mark.slow
def test_what_keras_2_cannot_do_is_refused_and_compression_and_determinism_work(runs):
    refused = runs["refusals"]
    assert refused["zero"] == {"raised": "ValueError", "message": (
        "zero_stage > 0: tower 0's optimizer is a tf_keras (Keras 2) Adam, whose slots are "
        "made and updated whole, one per variable; ZeRO updates shards with Keras 3's "
        "optimizers: use zero_stage=0, or keras.optimizers.Adam")}
    assert refused["mixed"] == {"raised": "ValueError", "message": (
        "tower 0: a tf_keras model under the mixed_float16 policy: the trainer scales "
        "losses with Keras 3's LossScaleOptimizer only; train it in float32, or build it "
        "with Keras 3")}
    assert refused["compression"] == {"drift": 0.0}
    one, two = runs["deterministic"]
    assert one == two


@pytest.mark.slow
def test_a_tf_keras_cnn_compiled_per_tower_trains_to_the_uncompiled_weights(runs):
    got = runs["compiled"]
    assert got["clusters"] == ["/device:CPU:0", "/device:CPU:1"] and got["drift"] == 0.0
    assert 0 < got["vs_uncompiled"] < 1e-5  # XLA rounds otherwise: float32 rounding, 8 steps


@pytest.mark.slow
@pytest.mark.parametrize("step", ["explicit", "implicit"])
def test_tf_model_gardens_steps_reduce_through_tfreduce_as_tfs_own_ops(runs, step):
    # official/modeling/grad_utils.py's minimize_using_explicit_allreduce
    # (the replica context's all-reduce, then apply_gradients with
    # experimental_aggregate_gradients=False) and its default (the tf_keras
    # optimizer's own aggregation), on MirroredStrategy with CrossDeviceOps:
    # tfreduce's reduction is built, and the weights are TF's own ops' bits.
    got = runs["model_garden"][step]
    assert got["reductions"] > 0 and got["vs_tf_ops"] == 0.0


HOROVOD_WORKER = Path(__file__).parent / "workers" / "horovod_keras2_worker.py"


@pytest.mark.slow
def test_horovods_keras_api_on_keras_2_trains_two_processes_as_one(tmp_path):
    # tfreduce.tensorflow.keras with tf_keras as tf.keras: fit with both
    # optimizer families, a custom loop of backward_passes_per_step=3 with a
    # local variable, load_model; 2 processes under the launcher (no
    # preloaded TensorFlow: TF_USE_LEGACY_KERAS must be set before it starts).
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run([sys.executable, "-m", "tfreduce.launch", "--workers", "2",
                           "--timeout", "240", "--", sys.executable, str(HOROVOD_WORKER),
                           str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    found = {}
    for line in (done.stdout + done.stderr).splitlines():
        head, _, rest = line.partition("] ")
        if rest.startswith('{"rank"'):
            got = json.loads(rest)
            found[got["rank"]] = got
    assert sorted(found) == [0, 1] and found[0]["keras2"]
    for rank, got in found.items():
        for family, name in (("sgd", "SGD"), ("legacy_adam", "Adam")):
            # Each rank's half of every global batch, all-reduced: the
            # weights of one process trained on the whole batches.
            assert got[family]["optimizer"] == name and got[family]["iterations"] == 8
            assert got[family]["vs_one_process"] < 1e-6, (rank, family, got[family])
            assert got[family]["loss"] == found[0][family]["loss"]
        # 7 calls, updates at calls 3 and 6 of the summed gradients (3 c),
        # x's averaged over ranks (c = [r + 1, 2 (r + 1)]), the local
        # variable's its rank's own divided by 2 (NumPy below).
        c = np.array([rank + 1.0, 2.0 * (rank + 1.0)])
        mean_c = np.array([1.5, 3.0])
        assert got["loop"] == {"x": (1.0 - 2 * 0.5 * 3 * mean_c).tolist(),
                               "mine": (1.0 - 2 * 0.5 * 3 * c / 2).tolist(),
                               "iterations": 7, "counter": 1}
        assert got["tape_vs_one_process"] < 1e-6, got["tape_vs_one_process"]
        assert {k: got["load"][k] for k in ("distributed", "optimizer", "slots_equal")} == {
            "distributed": True, "optimizer": "SGD", "slots_equal": True}
    assert found[0]["load"]["weights"] == found[1]["load"]["weights"]
