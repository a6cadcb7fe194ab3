"""algorithm="auto" with topology=: the cost model's plan, in the dispatcher, trainer and Keras."""

import collections
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfreduce
import tfreduce.doors.allreduce
from helpers import CPU_DEVICES, GPU_DEVICES, check, load_script, place
from tfreduce.analysis import planner
from tfreduce.algorithms import registry
from tfreduce.workers.cluster import Cluster
from tfreduce.analysis.costmodel import predict
from tfreduce.algorithms.replicated import FlatStage
from tfreduce.trainer import ReplicatedTrainer

WORKER = os.path.join(os.path.dirname(__file__), "workers", "keras_fit_worker.py")
worker = load_script(WORKER, "keras_fit_worker")

# Textbook machines where the closed forms decide: with no latency, a ring
# moves 2(K-1)/K S per device against flat's 2S (the ring wins, tied with the
# collective, which is tried after it: ties go to the first tried); with one
# second per hop and tiny gradients, flat's two hops beat the ring's 2(K-1).
BANDWIDTH_BOUND = tfreduce.Topology.fully_connected(8, 1e9, 0.0)
LATENCY_BOUND = tfreduce.Topology.fully_connected(8, 1e9, 1.0)


def scopes(graph):
    """The all-reduce name scopes of a graph's ops."""
    return {op.name.split("/")[0] for op in graph.get_operations()
            if op.name.startswith("allreduce")}


def spy_on_plans(monkeypatch):
    """The plans the dispatcher makes, recorded as it makes them, from no kept plan."""
    plans = []
    planner.forget_plans()

    def recording(*args):
        plans.append(planner.plan_for(*args))
        return plans[-1]

    monkeypatch.setattr(tfreduce.choice.reduction, "plan_for", recording)
    return plans


@pytest.mark.slow
@pytest.mark.parametrize("num_devices", [4, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("topology, size, want", [
    (BANDWIDTH_BOUND, 2**16, "ring"), (LATENCY_BOUND, 1, "flat")])
def test_auto_with_a_topology_runs_the_planned_algorithm(topology, size, want, num_devices,
                                                         runner):
    devices = CPU_DEVICES[:num_devices]
    rng = np.random.default_rng(num_devices)
    # Whole numbers: every summation order gives NumPy's sum exactly.
    arrays = [[rng.integers(-50, 50, size=[size]).astype(np.float32),
               rng.integers(-50, 50, size=[4, 2]).astype(np.float32)] for _ in devices]
    plan = tfreduce.plan_allreduce([[size], [4, 2]], devices, topology, average=False)
    assert plan.algorithm == want
    with tf.Graph().as_default():
        out = tfreduce.allreduce_grads(place(arrays, devices), devices, topology=topology)
        assert scopes(out[0][0].graph) == {f"allreduce_{want}"}
    values, placed = runner(
        lambda grads: tfreduce.allreduce_grads(grads, devices, topology=topology),
        arrays, devices)
    check(values, placed, arrays, False, [d[len("/device"):] for d in devices])


def op_types(outputs):
    graph = outputs[0][0].graph
    return collections.Counter(op.type for op in graph.get_operations())


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["dgx1-v100", pytest.param("pcie3x8", marks=pytest.mark.slow)])
def test_the_dispatcher_builds_what_plan_allreduce_names(preset):
    # Groups and pack size included: the same ops as the plan's keywords.
    shapes = [[3, 3, 64, 64], [64], [1024, 100], [100]]
    plan = tfreduce.plan_allreduce(shapes, GPU_DEVICES, preset, average=True)
    built = {}
    for how, kwargs in (("auto", {"topology": preset}), ("plan", plan.kwargs())):
        with tf.Graph().as_default():
            grads = []
            for d in GPU_DEVICES:
                with tf.device(d):
                    grads.append([tf.zeros(s) for s in shapes])
            built[how] = op_types(tfreduce.allreduce_grads(grads, GPU_DEVICES, average=True,
                                                           **kwargs))
    assert built["auto"] == built["plan"]


def test_a_given_pack_size_and_compression_are_kept():
    plan = tfreduce.plan_allreduce([[2**16], [10]], CPU_DEVICES[:4], BANDWIDTH_BOUND,
                                   pack_bytes=2**20, compression="fp16")
    assert {options["pack_bytes"] for _, options, _ in plan.table} == {2**20}
    # fp16 halves the bytes on the wire: half the time of the uncompressed plan.
    plain = tfreduce.plan_allreduce([[2**16], [10]], CPU_DEVICES[:4], BANDWIDTH_BOUND,
                                    pack_bytes=2**20)
    assert plan.seconds == pytest.approx(plain.seconds / 2, rel=1e-3)


def test_a_plan_made_again_reuses_the_costed_table(monkeypatch):
    costed = []
    monkeypatch.setattr(planner, "predict",
                        lambda *args, **kwargs: costed.append(1) or predict(*args, **kwargs))
    # A topology no other test plans on, made twice: equal figures, one key.
    machine = lambda: tfreduce.Topology.fully_connected(4, 1.25e9, 3e-6)  # noqa: E731
    shapes, devices, given = [[256, 10], [10]], CPU_DEVICES[:4], {"pack_bytes": 2**20}
    first = tfreduce.plan_allreduce(shapes, devices, machine(), **given)
    tried = len(first.table)
    assert len(costed) == tried == len(planner.candidates(devices, [2**20]))
    first.options["pack_bytes"] = 1  # a plan's options are its own
    again = tfreduce.plan_allreduce(shapes, devices, machine(), **given)
    assert len(costed) == tried
    assert again.options["pack_bytes"] == 2**20 and again.table[0][1] == again.options
    assert (again.algorithm, again.seconds) == (first.algorithm, first.seconds)
    # Another average or compression is another key: costed anew.
    tfreduce.plan_allreduce(shapes, devices, machine(), average=False, **given)
    assert len(costed) == 2 * tried
    tfreduce.plan_allreduce(shapes, devices, machine(), compression="bf16", **given)
    assert len(costed) == 3 * tried

@pytest.mark.slow
def test_a_new_algorithm_is_its_module_and_one_line(tmp_path):
    # What a user adds: a module with its Stage, and its line in
    # choices.STAGE_CLASSES (set here before tfreduce's other modules import it).
    (tmp_path / "toy_algorithm.py").write_text(textwrap.dedent("""
        from tfreduce.algorithms.replicated import FlatStage

        class ToyStage(FlatStage):
            name = "toy"
    """))
    code = textwrap.dedent("""
        import tfreduce.basis.choices as choices
        choices.STAGE_CLASSES["toy"] = "toy_algorithm:ToyStage"
        choices.ALGORITHMS += ("toy",)
        import tensorflow as tf
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0],
            [tf.config.LogicalDeviceConfiguration()] * 2)
        import tfreduce
        from tfreduce.algorithms import registry
        grads = [[tf.constant([1.0, 2.0])], [tf.constant([3.0, 4.0])]]
        out = tfreduce.allreduce_grads(grads, ["/cpu:0", "/cpu:1"], algorithm="toy")
        print(registry.STAGES["toy"].__name__, out[1][0].numpy().tolist())
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "ToyStage [4.0, 6.0]"



def test_the_planner_costs_every_registered_algorithm(monkeypatch):
    # A toy algorithm: one registry entry, with an option set of its own
    # that the planner tries, and one that bind refuses on these devices.
    class Toy(FlatStage):
        name = "toy"

        def __init__(self, width=1):
            self.width = width

        @classmethod
        def plan_options(cls, num_devices):
            return [{"width": num_devices}, {"width": 0}]

        def bind(self, devices):
            if self.width != len(devices):
                raise ValueError(f"toy takes width {len(devices)}, got {self.width}")
            return self

    monkeypatch.setitem(registry.STAGES, "toy", Toy)
    sizes = [None, 2**20]
    tried = planner.candidates(CPU_DEVICES[:4], sizes)
    assert [row for row in tried if row[0] == "toy"] == [
        ("toy", {"pack_bytes": None, "width": 4}), ("toy", {"pack_bytes": 2**20, "width": 4})]
    # Every registered algorithm that binds on CPUs; NCCL refuses them.
    assert {name for name, _ in tried} == set(registry.STAGES) - {"nccl"}
    plan = tfreduce.plan_allreduce([[64, 10]], CPU_DEVICES[:4], BANDWIDTH_BOUND,
                                   pack_bytes=None)
    assert ("toy", {"pack_bytes": None, "width": 4}) in [(a, o) for a, o, _ in plan.table]


def test_sparse_gradients_alone_take_the_default_rule(monkeypatch):
    plans = spy_on_plans(monkeypatch)
    devices = CPU_DEVICES[:2]
    grads = []
    for k, d in enumerate(devices):
        with tf.device(d):
            grads.append([tf.IndexedSlices(tf.ones([1, 3]) * (k + 1), tf.constant([k]),
                                           tf.constant([4, 3]))])
    out = tfreduce.allreduce_grads(grads, devices, topology=BANDWIDTH_BOUND)
    assert plans == [None]
    np.testing.assert_array_equal(tf.convert_to_tensor(out[1][0]).numpy(),
                                  [[1, 1, 1], [2, 2, 2], [0, 0, 0], [0, 0, 0]])


@pytest.mark.slow
def test_the_trainer_plans_and_trains_as_the_named_algorithm(monkeypatch):
    plans = spy_on_plans(monkeypatch)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 5)), rng.integers(0, 3, size=32)

    def model_fn():
        keras.utils.set_random_seed(3)
        return keras.Sequential([keras.Input((5,), dtype="float64"),
                                 keras.layers.Dense(3, dtype="float64")])

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    trainers = {name: ReplicatedTrainer(model_fn, loss, lambda: keras.optimizers.SGD(0.1),
                                        devices=CPU_DEVICES[:2], **kwargs)
                for name, kwargs in (("planned", {"topology": BANDWIDTH_BOUND}),
                                     ("ring", {"algorithm": "ring"}))}
    for trainer in trainers.values():
        for step in range(3):
            trainer.train_step(x[step * 8:(step + 1) * 8], y[step * 8:(step + 1) * 8])
    assert plans and {plan.algorithm for plan in plans} == {"ring"}
    for got, want in zip(trainers["planned"].models[1].get_weights(),
                         trainers["ring"].models[1].get_weights()):
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_keras_fit_with_cross_device_ops_follows_the_plan(monkeypatch):
    plans = spy_on_plans(monkeypatch)
    got, _ = worker.fit_weights(CPU_DEVICES[:2],
                                tfreduce.CrossDeviceOps(topology=BANDWIDTH_BOUND),
                                "float64", False)
    want, _ = worker.fit_weights(CPU_DEVICES[:2], tfreduce.CrossDeviceOps("ring"),
                                 "float64", False)
    assert plans and {plan.algorithm for plan in plans} == {"ring"}
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def two_grads():
    grads = []
    for d in CPU_DEVICES[:2]:
        with tf.device(d):
            grads.append([tf.ones([3])])
    return grads


@pytest.mark.parametrize("kwargs, error, message", [
    ({"algorithm": "ring", "topology": "dgx-a100"}, ValueError,
     "topology= chooses the algorithm (algorithm='auto'), but algorithm='ring' was named: "
     "pass one of them"),
    ({"topology": "dgx-a100", "groups": [[0, 1]]}, TypeError,
     "planning takes only the frame's options ['pack_bytes', 'sparse_as_dense', "
     "'compression'], got ['groups']: the plan picks the algorithm and its groups"),
    ({"topology": "dgx-z"}, ValueError, "unknown topology preset 'dgx-z'"),
    ({"topology": 8}, TypeError,
     'topology must be a tfreduce.Topology, a preset name or "host", got int 8'),
    ({"topology": tfreduce.Topology.fully_connected(1, 1e9)}, ValueError,
     "topology 'fully_connected(1)' has 1 devices, fewer than the 2 given"),
])
def test_dispatcher_errors(kwargs, error, message):
    with pytest.raises(error) as info:
        tfreduce.allreduce_grads(two_grads(), CPU_DEVICES[:2], **kwargs)
    assert message in str(info.value)


def test_a_gradient_of_unknown_shape_is_named():
    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)] * 2)
    def reduce(a, b):
        with tf.device(CPU_DEVICES[0]):
            a = tf.identity(a)
        with tf.device(CPU_DEVICES[1]):
            b = tf.identity(b)
        return tfreduce.allreduce_grads([[a], [b]], CPU_DEVICES[:2], topology="dgx-a100")

    with pytest.raises(ValueError) as info:
        reduce.get_concrete_function()
    assert ("algorithm='auto' with topology= costs the gradients' static shapes: tower 0's "
            "gradient of variable 0 has shape (None,)") in str(info.value)


def test_trainer_and_keras_errors_at_construction():
    def model_fn():
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])

    with pytest.raises(ValueError) as info:
        ReplicatedTrainer(model_fn, "mse", keras.optimizers.SGD, devices=CPU_DEVICES[:2],
                          algorithm="flat", topology="dgx-a100")
    assert "algorithm='flat' was named" in str(info.value)
    with pytest.raises(ValueError) as info:
        ReplicatedTrainer(model_fn, "mse", keras.optimizers.SGD, devices=CPU_DEVICES[:2],
                          topology=tfreduce.Topology.fully_connected(1, 1e9))
    assert "has 1 devices, fewer than the 2 given" in str(info.value)
    with pytest.raises(ValueError) as info:
        tfreduce.CrossDeviceOps("hierarchical", topology="dgx-a100")
    assert "algorithm='hierarchical' was named" in str(info.value)
    with pytest.raises(TypeError) as info:
        tfreduce.CrossDeviceOps(topology="dgx-a100", groups=[[0, 1]])
    assert "got ['groups']: the plan picks the algorithm and its groups" in str(info.value)


def test_a_cluster_takes_no_topology():
    cluster = Cluster({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "worker", 0)
    with pytest.raises(ValueError) as info:
        tfreduce.allreduce_grads_multiworker(two_grads(), CPU_DEVICES[:2], cluster=cluster,
                                             local_options={"topology": "dgx-a100"})
    assert ("local_options topology='dgx-a100': a plan is for the devices of one process; "
            "across workers pass its choice as local_algorithm and local_options "
            "(tfreduce.plan_allreduce(...).kwargs())") in str(info.value)
