"""ReplicatedTrainer on Keras 2 (tf_keras) models and optimizers, in a process of its own.

``TF_USE_LEGACY_KERAS=1`` must be set before TensorFlow starts, so the runs
are tests/workers/keras2_worker.py's (one process for all of them): a
Sequential without an Input, a subclassed model and a BatchNormalization
CNN train on 2 towers with their replicas equal, to the weights of one
tower (float32 rounding; the CNN's BatchNormalization normalises each
tower's shard, so it is left out of that comparison), and a run saved and
resumed equals the uninterrupted one; ZeRO and mixed float16 are refused
with messages; deterministic=True gives the same bits on 1 and 2 towers.
"""

import json
import subprocess
import sys
from pathlib import Path

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
