"""Overlap of the reduction with the backward pass: buckets in backward order.

The trainer's step is read as a graph (nothing about time is asserted
here): each bucket's reduction must depend on its own gradients only, so
TensorFlow's executor can start it as soon as the backward pass has
produced them.
"""

import gzip
import json
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfreduce
from helpers import CPU_DEVICES, GPU_DEVICES, placeholders
from test_trainer import LOSS, sgd
from tfreduce.bench.overlap_mode import _AfterEveryGradient
from tfreduce.analysis.profiler import architecture
from tfreduce.doors.stepmodel import layer_flops, layer_seconds
from tfreduce.analysis.timeline import COMMUNICATION, STAGES, Slice, Timeline, stage_of
from tfreduce.trainer import ReplicatedTrainer


def deep_mlp():
    """Four float32 Dense layers, 8 trainable variables of 64 to 1,024 bytes."""
    return keras.Sequential([keras.Input((8,))]
                            + [keras.layers.Dense(16, activation="relu") for _ in range(3)]
                            + [keras.layers.Dense(4)])


def gradient_ancestors(graph, marked):
    """{op: set of variable indices whose gradient is among op's ancestors (or op itself)}.

    marked: {op: variable index} of the ops that output a tower's gradient.
    """
    found = {}
    for op in graph.get_operations():  # creation order: inputs come first
        seen = {marked[op]} if op in marked else set()
        for dep in [t.op for t in op.inputs] + list(op.control_inputs):
            seen |= found.get(dep, set())
        found[op] = seen
    return found


def traced_step(monkeypatch, **options):
    """A trained step's graph and {gradient op: variable index} of every tower."""
    marked = {}
    original = tf.GradientTape.gradient

    def recording(tape, target, sources, *args, **kwargs):
        grads = original(tape, target, sources, *args, **kwargs)
        for n, g in enumerate(grads):
            marked[g.op] = n
        return grads

    monkeypatch.setattr(tf.GradientTape, "gradient", recording)
    trainer = ReplicatedTrainer(deep_mlp, LOSS, sgd, devices=CPU_DEVICES[:4], **options)
    rng = np.random.default_rng(0)
    trainer.train_step(rng.normal(size=(16, 8)).astype("float32"), rng.integers(0, 4, 16))
    monkeypatch.undo()
    graph = trainer.step_graphs()["train"]
    return graph, {op: n for op, n in marked.items() if op.graph is graph}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["flat", "ring", "hierarchical"])
def test_each_bucket_reduction_depends_only_on_its_own_gradients(algorithm, monkeypatch):
    # pack_bytes=400, backward order: [7, 6, 5, 3] (16 + 256 + 64 + 64
    # bytes), 4 and 2 (1,024-byte kernels) passed through, [1] (464 > 400
    # opens another), 0 (512) passed through. The buckets are read from
    # the graph: the largest sets of gradients some reduction op reads.
    graph, marked = traced_step(monkeypatch, algorithm=algorithm, pack_bytes=400)
    assert sorted(set(marked.values())) == list(range(8))
    ancestors = gradient_ancestors(graph, marked)
    reduction = [op for op in graph.get_operations() if "allreduce_" in op.name]
    sets = [ancestors[op] for op in reduction if ancestors[op]]
    buckets = {frozenset(s) for s in sets if not any(s < other for other in sets)}
    # Every reduction op reads the gradients of one bucket only: the
    # largest sets do not overlap.
    assert sorted(map(sorted, buckets)) == [[0], [1], [2], [3, 5, 6, 7], [4]]
    assert sum(len(b) for b in buckets) == len(set().union(*buckets)) == 8
    # The first bucket (pack 0 of tower 0) holds the last variable and does
    # not wait for the first layer's gradients (its kernel 0 and bias 1).
    first = next(op for op in reduction if op.name.endswith("dev0_pack0"))
    assert ancestors[first] == {3, 5, 6, 7}


@pytest.mark.slow
def test_the_benchs_no_overlap_contender_reduces_after_every_gradient(monkeypatch):
    # tfreduce-bench --overlap's baseline: the same reduction behind a barrier.
    graph, marked = traced_step(monkeypatch, reduction=_AfterEveryGradient("ring", pack_bytes=400))
    ancestors = gradient_ancestors(graph, marked)
    # Constants (the padding's zeros, split sizes) read no gradient.
    reduction = [op for op in graph.get_operations()
                 if "allreduce_" in op.name and op.type != "Const"]
    assert reduction and all(ancestors[op] == set(range(8)) for op in reduction)


# ------------------------------------------------------------------ timelines

def check_chrome_trace(doc):
    """Asserts the Chrome trace event format's JSON object form, as tfreduce writes it."""
    assert set(doc) == {"traceEvents", "displayTimeUnit", "otherData"}
    assert doc["displayTimeUnit"] in ("ms", "ns")
    for event in doc["traceEvents"]:
        assert event["ph"] in ("X", "M") and isinstance(event["name"], str)
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        if event["ph"] == "X":
            assert isinstance(event["cat"], str) and event["cat"] in STAGES
            assert event["ts"] >= 0 and event["dur"] >= 0
        else:
            assert event["name"] in ("process_name", "thread_name", "thread_sort_index")
            assert isinstance(event["args"], dict)


def tracks_of(doc):
    return {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def wide_mlp():
    return keras.Sequential([keras.Input((64,))]
                            + [keras.layers.Dense(256, activation="relu") for _ in range(4)]
                            + [keras.layers.Dense(10)])


@pytest.mark.slow
def test_a_profiled_fit_shows_the_reduction_start_before_the_backward_pass_ends(tmp_path):
    trainer = ReplicatedTrainer(wide_mlp, LOSS, sgd, devices=CPU_DEVICES[:4], algorithm="ring")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(512, 64)).astype("float32"), rng.integers(0, 10, 512)
    trainer.fit(x, y, batch_size=128, verbose=0, logdir=str(tmp_path), profile_steps=(2, 3))
    doc = json.loads(gzip.decompress((tmp_path / "timeline.json.gz").read_bytes()))
    check_chrome_trace(doc)
    assert doc["otherData"]["source"] == "measured"
    tracks = tracks_of(doc)
    assert [tracks[t] for t in sorted(tracks)][:4] == ["tower 0", "tower 1", "tower 2", "tower 3"]
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    steps = [e for e in slices if e["args"]["type"] == "step"]
    assert [e["name"] for e in steps] == ["step 2", "step 3"]
    for step in steps:
        inside = [e for e in slices if step["ts"] <= e["ts"] < step["ts"] + step["dur"]]
        seen = {(tracks[e["tid"]], e["cat"]) for e in inside}
        for k in range(4):
            for stage in ("forward", "backward", "local reduce", "broadcast", "apply"):
                assert (f"tower {k}", stage) in seen
        backward_end = max(e["ts"] + e["dur"] for e in inside if e["cat"] == "backward")
        reduction_start = min(e["ts"] for e in inside if e["cat"] in COMMUNICATION)
        assert reduction_start < backward_end
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # TensorBoard's profile tab finds the profiler's own file beside it.
    assert list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))
    predicted_from_the_measured_compute(trainer.models, tmp_path / "timeline.json.gz", slices,
                                        tracks)


def predicted_from_the_measured_compute(models, path, slices, tracks):
    # Each tower's ops of layer i are under the scope the profile found
    # for it (replica k's layer name, with TF's _N); a layer's time is their
    # durations averaged over 4 towers and 2 steps.
    loaded = Timeline.load(path)
    assert loaded.tracks[:4] == ["tower 0", "tower 1", "tower 2", "tower 3"]
    assert len(loaded.slices) == len(slices)
    names = [layer.name for layer in models[0].layers]
    for k, model in enumerate(models):
        for i, layer in enumerate(model.layers):
            (scope,) = [s for s, index in loaded.layers.items()
                        if index == i and s.startswith(f"tower{k}/")]
            assert re.fullmatch(rf"{layer.name}(_\d+)*", scope.rsplit("/", 1)[1])
    times = layer_seconds(loaded, models[0])
    assert set(times) == set(names) | {None}  # None: the loss and its gradient
    # In each step, a tower's compute ops are scaled to their span: stretched
    # where the executor waited between them, shrunk where they overlapped
    # (the inter-op pool runs a tower's independent ops side by side; a
    # run beside other processes once gave 0.98).
    want = {(name, stage): 0.0 for name in names for stage in ("forward", "backward")}
    for step in [e for e in slices if e["args"]["type"] == "step"]:
        for k in range(4):
            ops = [e for e in slices if tracks[e["tid"]] == f"tower {k}"
                   and e["cat"] in ("forward", "backward")
                   and step["ts"] <= e["ts"] < step["ts"] + step["dur"]]
            span = max(e["ts"] + e["dur"] for e in ops) - min(e["ts"] for e in ops)
            stretch = span / sum(e["dur"] for e in ops)
            for i, name in enumerate(names):
                scopes = tuple(s + "/" for s, index in loaded.layers.items() if index == i)
                for e in ops:
                    if e["name"].removeprefix("gradient_tape/").startswith(scopes):
                        want[(name, e["cat"])] += e["dur"] * stretch * 1e-6 / 8
    for (name, stage), seconds in want.items():
        measured = times[name][stage == "backward"]
        assert seconds > 0 and measured == pytest.approx(seconds, rel=1e-6)
    step = tfreduce.predict_step(models[0], 32, "dgx1-v100", num_towers=4, compute=loaded)
    assert step.compute_seconds == pytest.approx(sum(f + b for f, b in times.values()))
    # The update: the span of a tower's apply ops, averaged over its steps.
    spans = []
    for step_slice in [e for e in slices if e["args"]["type"] == "step"]:
        for k in range(4):
            ops = [e for e in slices if tracks[e["tid"]] == f"tower {k}" and e["cat"] == "apply"
                   and step_slice["ts"] <= e["ts"] < step_slice["ts"] + step_slice["dur"]]
            spans.append((max(e["ts"] + e["dur"] for e in ops) - min(e["ts"] for e in ops)) * 1e-6)
    assert step.apply_seconds == pytest.approx(sum(spans) / 8, rel=1e-6)
    assert step.seconds == pytest.approx(step.compute_seconds + step.exposed_seconds
                                         + step.apply_seconds)
    # The first layer's gradients exist last, at the backward pass's end;
    # the last layer's once the loss's gradient and its own backward ran.
    assert step.ready[0] == pytest.approx(step.compute_seconds)
    assert step.ready[-1] == pytest.approx(
        sum(f for f, _ in times.values()) + times[None][1] + times[names[-1]][1])
    # A model built alike in another process (other layer names) reads it.
    again = tfreduce.predict_step(wide_mlp(), 32, "dgx1-v100", num_towers=4, compute=path)
    assert again.ready == pytest.approx(step.ready)
    # Another model: its first layer's variables differ.
    other = keras.Sequential([keras.Input((64,)), keras.layers.Dense(2)], name="other")
    with pytest.raises(ValueError, match=re.escape(
            "the measured timeline's steps trained another model than 'other': layer 0 is "
            "Dense with variables [(64, 256), (256,)] there and Dense with variables [(64, 2), "
            "(2,)] here (5 layers there, 1 here): pass the model the steps trained, or one "
            "built alike")):
        layer_seconds(loaded, other)


@pytest.mark.slow
def test_a_model_without_an_input_is_profiled_once_its_first_batch_built_it(tmp_path):
    def lazy():
        return keras.Sequential([keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dense(4)])

    trainer = ReplicatedTrainer(lazy, LOSS, sgd, devices=CPU_DEVICES[:2])
    x, y = np.zeros((8, 8), np.float32), np.zeros(8, np.int64)
    trainer.fit(x, y, batch_size=4, verbose=0, logdir=str(tmp_path), profile_steps=(1, 1))
    timeline = Timeline.load(tmp_path / "timeline.json.gz")
    assert timeline.architecture == [["Dense", [[8, 16], [16]]], ["Dense", [[16, 4], [4]]]]
    assert sorted(set(timeline.layers.values())) == [0, 1]


def test_a_profile_window_the_run_does_not_reach_is_said_before_the_first_step(tmp_path):
    # Once, fit(profile_steps=(50, 60)) on a 4-step run wrote nothing and
    # said nothing. Raised here (warnings as errors): no step has run.
    trainer = ReplicatedTrainer(deep_mlp, LOSS, sgd, devices=CPU_DEVICES[:2])
    x, y = np.zeros((8, 8), np.float32), np.zeros(8, np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning) as info:
            trainer.fit(x, y, epochs=2, batch_size=4, verbose=0, logdir=str(tmp_path),
                        profile_steps=(50, 60))
    assert str(info.value) == ("fit(profile_steps=(50, 60)): this run trains steps 1..4, none "
                               "in the window: no timeline is written")
    assert trainer.step == 0


@pytest.mark.slow
def test_a_run_outside_its_profile_window_trains_writes_no_timeline_and_says_why(tmp_path):
    trainer = ReplicatedTrainer(deep_mlp, LOSS, sgd, devices=CPU_DEVICES[:2])
    x, y = np.zeros((8, 8), np.float32), np.zeros(8, np.int64)
    for runs in ("trains steps 1..4", "trains no step (the step counter is at 4 of 4)"):
        with pytest.warns(UserWarning) as record:
            trainer.fit(x, y, epochs=2, batch_size=4, verbose=0, logdir=str(tmp_path),
                        profile_steps=(50, 60))
        assert [str(w.message) for w in record] == [
            f"fit(profile_steps=(50, 60)): this run {runs}, none in the window: no timeline "
            f"is written"]
        assert record[0].filename == __file__  # the line that called fit
    assert trainer.step == 4 and not list(tmp_path.glob("timeline*"))


@pytest.mark.parametrize("steps, logdir, error, message", [
    ((0, 2), "x", ValueError, r"profile_steps must be 1 <= first <= last \(1-based step "
                              r"numbers\), got \(0, 2\)"),
    ((3, 2), "x", ValueError, r"1 <= first <= last .*got \(3, 2\)"),
    ("2", "x", TypeError, r"profile_steps must be an int step or a pair \(first, last\) of int "
                          r"steps, got '2'"),
    ((1, 2), None, ValueError, r"profile_steps=\(1, 2\) needs logdir: the profile and its "
                               r"timeline are written there"),
])
def test_bad_profile_steps(steps, logdir, error, message):
    trainer = ReplicatedTrainer(deep_mlp, LOSS, sgd, devices=CPU_DEVICES[:2])
    x = np.zeros((8, 8), np.float32)
    with pytest.raises(error, match=message):
        trainer.fit(x, np.zeros(8, np.int64), batch_size=4, verbose=0, logdir=logdir,
                    profile_steps=steps)
    assert trainer.step == 0


@pytest.mark.parametrize("name, stage", [
    ("tower1/sequential_1/dense/MatMul", "forward"),
    ("gradient_tape/tower1/sequential_1/dense/MatMul/MatMul_1", "backward"),
    ("allreduce_ring/dev1_pack0", "pack"),
    ("allreduce_ring/dev1_unpack0_tail", "unpack"),
    ("allreduce_ring/entry0_chunk1_dev2_sum", "local reduce"),
    ("allreduce_hierarchical/entry0_group1_total", "local reduce"),
    ("allreduce_flat/entry3_dev1_out", "broadcast"),
    ("allreduce_cross_worker/entry0_allreduce", "cross-worker"),
    ("tower2_apply/cond/then/_58/tower2_apply/cond/sgd/Mul_5", "apply"),
    ("nonfinite_check/IsFinite", "other"),
])
def test_stage_of_names_the_stage_of_every_op_tfreduce_builds(name, stage):
    assert stage_of(name) == stage


def test_exposed_communication_is_the_reduction_time_no_compute_covers(tmp_path):
    # Backward 0-4 ms on tower 0, the reduction 3-6 ms on tower 1, apply
    # 5-7: of the reduction, 3-4 overlaps the backward pass and 5-6 the
    # apply; 4-5 is exposed.
    ms = 1e-3
    timeline = Timeline([
        Slice("tower 0", "b", "MatMul", "backward", 10 * ms, 4 * ms),
        Slice("tower 1", "r", "AddN", "local reduce", 13 * ms, 3 * ms),
        Slice("tower 1", "o", "Identity", "broadcast", 14 * ms, 1 * ms),
        Slice("tower 0", "a", "Mul", "apply", 15 * ms, 2 * ms),
    ], "measured")
    assert timeline.slices[0].start == 0.0  # counted from the first slice
    assert timeline.exposed_communication() == pytest.approx(1 * ms)
    assert timeline.busy(COMMUNICATION) == pytest.approx(3 * ms)
    assert timeline.tracks == ["tower 0", "tower 1"]
    doc = timeline.to_chrome()
    check_chrome_trace(doc)
    # Saved plain or gzipped, it reads back the same.
    for name in ("t.json", "t.json.gz"):
        path = timeline.save(tmp_path / name)
        assert (open(path, "rb").read(2) == b"\x1f\x8b") == name.endswith(".gz")
        again = Timeline.load(path)
        assert (again.source, again.process) == (timeline.source, timeline.process)
        assert [(s.track, s.name, s.op_type, s.stage) for s in again.slices] == [
            (s.track, s.name, s.op_type, s.stage) for s in timeline.slices]
        assert [t for s in again.slices for t in (s.start, s.duration)] == pytest.approx(
            [t for s in timeline.slices for t in (s.start, s.duration)], abs=1e-9)
    assert [(e["name"], e["ts"], e["dur"]) for e in doc["traceEvents"] if e["ph"] == "X"] == [
        ("b", 0.0, 4000.0), ("r", 3000.0, 3000.0), ("o", 4000.0, 1000.0), ("a", 5000.0, 2000.0)]


def test_the_predicted_timeline_has_the_tracks_and_stages_of_a_measured_one(tmp_path):
    # The ring all-reduce of wide_mlp's gradients (the fit above) on 4 GPUs
    # of a DGX-1: towers by device, then the ring's links.
    shapes = [tuple(v.shape) for v in wide_mlp().trainable_variables]
    devices = GPU_DEVICES[:4]
    graph = tf.Graph()
    with graph.as_default():
        grads = placeholders(devices, shapes)
        out = tfreduce.allreduce_grads(grads, devices, algorithm="ring")
    prediction = tfreduce.predict(out, "dgx1-v100", inputs=grads, trace=tmp_path / "p.json")
    doc = json.loads((tmp_path / "p.json").read_text())
    check_chrome_trace(doc)
    assert doc["otherData"]["source"] == "predicted: dgx1-v100"
    assert sorted(tracks_of(doc).values()) == [
        "link 0->1", "link 1->2", "link 2->3", "link 3->0",
        "tower 0", "tower 1", "tower 2", "tower 3"]
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in slices} == {"pack", "local reduce", "broadcast", "unpack"}
    # Microseconds, rounded to the nanosecond.
    assert max(e["ts"] + e["dur"] for e in slices) == pytest.approx(prediction.seconds * 1e6,
                                                                   abs=2e-3)
    assert prediction.timeline.stages == ["pack", "local reduce", "broadcast", "unpack"]


# ------------------------------------------------------------------ a predicted step

def test_predict_step_reduces_each_gradient_once_its_layers_backward_pass_is_done(tmp_path):
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    rate = 1e12
    step = tfreduce.predict_step(model, 32, "dgx1-v100", num_towers=4, flops_per_s=rate,
                                 reduction=tfreduce.Reduction("nccl", pack_bytes=None),
                                 trace=tmp_path / "step.json")
    first, last = 2 * 64 * 128 * 32 / rate, 2 * 128 * 10 * 32 / rate
    forward = first + last
    assert step.compute_seconds == pytest.approx(3 * forward)
    # The last layer's kernel and bias exist after its backward pass, the
    # first layer's after both.
    assert step.ready == pytest.approx([forward + 2 * last + 2 * first] * 2
                                       + [forward + 2 * last] * 2)
    assert step.apply_seconds == 0  # not modelled from FLOPs
    assert step.seconds == pytest.approx(step.compute_seconds + step.exposed_seconds)
    assert 0 < step.exposed_seconds < step.exposed_without_overlap
    assert step.exposed_fraction == pytest.approx(step.exposed_seconds / step.seconds)
    doc = json.loads((tmp_path / "step.json").read_text())
    check_chrome_trace(doc)
    tracks = tracks_of(doc)
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {"tower 0", "tower 1", "tower 2", "tower 3"} <= set(tracks.values())
    backward_end = max(e["ts"] + e["dur"] for e in slices if e["cat"] == "backward")
    assert backward_end == pytest.approx(step.compute_seconds * 1e6, abs=2e-3)
    # The last layer's gradients are on their way while the first layer's
    # backward pass runs.
    assert min(e["ts"] for e in slices if e["cat"] in COMMUNICATION) < backward_end


def test_layer_flops_and_the_rate_a_topology_needs():
    model = keras.Sequential([keras.Input((16, 16, 3)),
                              keras.layers.Conv2D(8, 3, padding="same"),
                              keras.layers.BatchNormalization(),
                              keras.layers.DepthwiseConv2D(3, padding="valid"),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(5)])
    conv, norm, depthwise, pool, dense = model.layers
    assert layer_flops(conv) == 2 * 16 * 16 * 8 * 3 * 3 * 3
    assert layer_flops(norm) == 0 and layer_flops(pool) == 0
    assert layer_flops(depthwise) == 2 * 14 * 14 * 8 * 3 * 3
    assert layer_flops(dense) == 2 * 8 * 5
    # Once a bare TypeError (an int times None).
    open_ended = keras.Sequential([keras.Input((None, None, 3)), keras.layers.Conv2D(8, 3)])
    with pytest.raises(ValueError, match=re.escape(
            f"layer {open_ended.layers[0].name!r} has output shape (None, None, None, 8), whose "
            f"sizes are not all known: build the model on an Input of known shape "
            f"(keras.Input((224, 224, 3)), not (None, None, 3))")):
        tfreduce.predict_step(open_ended, 8, "dgx1-v100", num_towers=2)
    with pytest.raises(ValueError, match=r"predict_step needs flops_per_s or a measured "
                                         r"compute timeline for topology 'pcie3x8': only "
                                         r"\['dgx-a100', 'dgx1-v100'\] have a published estimate"):
        tfreduce.predict_step(model, 8, "pcie3x8")
    with pytest.raises(ValueError, match=r"predict_step takes flops_per_s or a measured compute "
                                         r"timeline, not both"):
        tfreduce.predict_step(model, 8, "pcie3x8", flops_per_s=1e12, compute={})


def test_a_timeline_without_a_profiled_step_or_in_another_format_is_refused(tmp_path):
    compute = Timeline([Slice("tower 0", "tower0/m/d/MatMul", "MatMul", "forward", 0, 1)],
                       "measured")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"the measured timeline has 0 profiled step\(s\), 1 "
                                         r"tower track\(s\) with forward or backward ops and 0 "
                                         r"layer scope\(s\): predict_step needs the profiled "
                                         r"steps of a ReplicatedTrainer"):
        layer_seconds(compute, model)
    (tmp_path / "other.json").write_text('{"traceEvents": []}')
    with pytest.raises(ValueError, match=r"other.json is not a timeline tfreduce wrote \(no "
                                         r"traceEvents and otherData.source: KeyError: "
                                         r"'otherData'\)"):
        Timeline.load(tmp_path / "other.json")


def profiled(model, name="tower0/model"):
    """A measured Timeline of one step of ``model`` on tower 0, as a profiled fit reads it.

    Each layer takes 1 ms forward and 2 ms backward.
    """
    ms = 1e-3
    slices, layers, now = [Slice("host", "step 1", "step", "other", 0.0, 1.0)], {}, 0.0
    for i, layer in enumerate(model.layers):
        layers[f"{name}/{layer.name}"] = i
        slices.append(Slice("tower 0", f"{name}/{layer.name}/MatMul", "MatMul", "forward",
                            now, 1 * ms))
        now += 1 * ms
    for layer in model.layers[::-1]:
        slices.append(Slice("tower 0", f"gradient_tape/{name}/{layer.name}/MatMul", "MatMul",
                            "backward", now, 2 * ms))
        now += 2 * ms
    return Timeline(slices, "measured", layers=layers, architecture=architecture(model))


def two_layers():
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                             keras.layers.Dense(10)])


def test_a_timeline_predicts_the_model_it_profiled_and_refuses_another():
    model = two_layers()
    step = tfreduce.predict_step(model, 32, "dgx1-v100", num_towers=4, compute=profiled(model))
    assert step.compute_seconds == pytest.approx(2 * 3e-3)
    # Built alike (other layer names): the same layers, the same times.
    again = tfreduce.predict_step(two_layers(), 32, "dgx1-v100", num_towers=4,
                                  compute=profiled(model))
    assert again.ready == pytest.approx(step.ready)
    # Once, the profile of Dense(3) predicted this model without a word:
    # its first layer took the profiled layer's time, the others none.
    small = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    big = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512), keras.layers.Dense(512),
                            keras.layers.Dense(2)], name="big")
    with pytest.raises(ValueError) as info:
        tfreduce.predict_step(big, 32, "dgx1-v100", num_towers=4, compute=profiled(small))
    assert str(info.value) == (
        "the measured timeline's steps trained another model than 'big': layer 0 is Dense "
        "with variables [(4, 3), (3,)] there and Dense with variables [(64, 512), (512,)] here "
        "(1 layers there, 3 here): pass the model the steps trained, or one built alike")
    # The same layers, one more: the first difference is the missing one.
    deeper = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128),
                               keras.layers.Dense(10), keras.layers.Dense(10)], name="deeper")
    with pytest.raises(ValueError, match=re.escape(
            "layer 2 is missing there and Dense with variables [(10, 10), (10,)] here (2 layers "
            "there, 3 here)")):
        layer_seconds(profiled(model), deeper)
    # A timeline saved before it kept the layers' variables: only the
    # layer indices can be checked.
    old = profiled(big)
    old.architecture = []
    with pytest.raises(ValueError, match=r"the timeline has layer 2 but model '\w+' has 2 "
                                         r"layers: pass the model the steps trained"):
        layer_seconds(old, two_layers())


@pytest.mark.parametrize("kwargs, error, message", [
    # Once -1, 0 and 2.5 predicted a compute of -8.6e-11 s or a step of
    # -6912 s, and flops_per_s=0.0 raised a bare ZeroDivisionError.
    (dict(batch_per_tower=-1), ValueError, "predict_step: batch_per_tower must be an int >= 1, "
                                           "got -1"),
    (dict(batch_per_tower=0), ValueError, "batch_per_tower must be an int >= 1, got 0"),
    (dict(batch_per_tower=2.5), TypeError, "predict_step: batch_per_tower must be an int >= 1, "
                                           "got float 2.5"),
    (dict(batch_per_tower=True), TypeError, "batch_per_tower must be an int >= 1, got bool True"),
    (dict(flops_per_s=-1.0), ValueError, "predict_step: flops_per_s must be a finite number of "
                                         "FLOP/s > 0, or None (the topology's published rate), "
                                         "got -1.0"),
    (dict(flops_per_s=0.0), ValueError, "flops_per_s must be a finite number of FLOP/s > 0, or "
                                        "None (the topology's published rate), got 0.0"),
    (dict(flops_per_s=float("nan")), ValueError, "got nan"),
    (dict(flops_per_s="1e12"), TypeError, "published rate), got str '1e12'"),
    (dict(num_towers=0), ValueError, "predict_step: num_towers must be an int >= 1, got 0"),
    (dict(num_towers=9), ValueError, "predict_step: num_towers=9, but topology 'dgx1-v100' has "
                                     "8 devices: ask for at most that many, or use a topology "
                                     "of more (tfreduce.Topology.cluster)"),
    (dict(topology=None), TypeError, 'topology must be a tfreduce.Topology, a preset name or '
                                     '"host", got NoneType None'),
    (dict(reduction=42), TypeError, "predict_step: reduction must be a tfreduce.Reduction or an "
                                    "algorithm name, got int 42"),
    (dict(compute=42, flops_per_s=None), TypeError,
     "predict_step: compute must be a tfreduce.analysis.timeline.Timeline or the path of its saved file, "
     "got int 42"),
    (dict(model="resnet"), TypeError, "predict_step: model must be a built keras.Model, got str "
                                      "'resnet'"),
])
def test_predict_step_refuses_what_it_cannot_predict(kwargs, error, message):
    arguments = dict(model=two_layers(), batch_per_tower=32, topology="dgx1-v100", num_towers=8,
                     flops_per_s=1e12)
    arguments.update(kwargs)
    with pytest.raises(error) as info:
        tfreduce.predict_step(**arguments)
    assert message in str(info.value)


def test_predict_step_asks_for_a_model_built_on_its_first_batch_to_be_built():
    # Once it said "has no trainable variable to reduce".
    lazy = keras.Sequential([keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)],
                            name="lazy")
    with pytest.raises(ValueError) as info:
        tfreduce.predict_step(lazy, 32, "dgx1-v100", num_towers=4)
    assert str(info.value) == (
        "predict_step: model 'lazy' is not built yet (Keras builds a model without an Input on "
        "its first batch, and the prediction needs its variables and each layer's output "
        "shape): build it first, model.build((None, *input_shape)), or start it with "
        "keras.Input(input_shape)")
    lazy.build((None, 64))
    built = tfreduce.predict_step(lazy, 32, "dgx1-v100", num_towers=4)
    assert built.compute_seconds == pytest.approx(tfreduce.predict_step(
        two_layers(), 32, "dgx1-v100", num_towers=4).compute_seconds)
    assert built.compute_seconds == pytest.approx(
        3 * 2 * (64 * 128 + 128 * 10) * 32 / tfreduce.doors.stepmodel.SUSTAINED_FLOPS["dgx1-v100"])


def saved_trace(tmp_path, change=None, raw=None):
    """The path of a saved timeline, its Chrome trace changed by ``change`` (or bytes ``raw``)."""
    timeline = Timeline([Slice("tower 0", "tower0/d/MatMul", "MatMul", "forward", 0.0, 1e-3),
                         Slice("host", "step 1", "step", "other", 0.0, 2e-3)], "measured")
    path = tmp_path / "t.json"
    if raw is not None:
        path.write_bytes(raw)
        return path
    doc = timeline.to_chrome()
    if change:
        change(doc)
    path.write_text(json.dumps(doc))
    return path


def matmul(doc):
    """The event of the saved trace's forward op (traceEvents[6], after the step's)."""
    (event,) = [e for e in doc["traceEvents"] if e["name"] == "tower0/d/MatMul"]
    return event


@pytest.mark.parametrize("case, message", [
    # Once: bare KeyError: ('process_name', 0), KeyError: 7 and EOFError.
    ("empty", "(JSONDecodeError: Expecting value: line 1 column 1 (char 0))"),
    ("truncated", "(EOFError: Compressed file ended before the end-of-stream marker was "
                  "reached)"),
    ("no process", "(no process_name event)"),
    ("unknown thread", "(traceEvents[6] is on thread 7, which no thread_name event names)"),
    ("no args", "(traceEvents[6] has no 'args' field: {'name': 'tower0/d/MatMul', "),
    ("negative duration", "(Timeline: slice 1 ('tower0/d/MatMul') starts at 0.0 s and lasts "
                          "-0.001 s: both must be finite numbers, the duration >= 0)"),
    ("unknown stage", "(Timeline: slice 1 has stage 'compute', not one of ('forward', "),
])
def test_timeline_load_refuses_an_empty_truncated_or_inconsistent_file(tmp_path, case, message):
    whole = gzip.compress(saved_trace(tmp_path).read_bytes())
    path = {
        "empty": lambda: saved_trace(tmp_path, raw=b""),
        "truncated": lambda: saved_trace(tmp_path, raw=whole[:len(whole) // 2]),
        "no process": lambda: saved_trace(tmp_path, lambda doc: doc.update(traceEvents=[
            e for e in doc["traceEvents"] if e["name"] != "process_name"])),
        "unknown thread": lambda: saved_trace(tmp_path, lambda doc: matmul(doc).update(tid=7)),
        "no args": lambda: saved_trace(tmp_path, lambda doc: matmul(doc).pop("args")),
        "negative duration": lambda: saved_trace(tmp_path, lambda doc: matmul(doc).update(
            dur=-1000)),
        "unknown stage": lambda: saved_trace(tmp_path, lambda doc: matmul(doc).update(
            cat="compute")),
    }[case]()
    with pytest.raises(ValueError) as info:
        Timeline.load(path)
    assert str(info.value).startswith(f"{path} is not a timeline tfreduce wrote {message}")


def test_timeline_load_and_save_raise_os_errors_for_paths_that_are_no_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        Timeline.load(tmp_path / "missing.json")
    with pytest.raises(IsADirectoryError):
        Timeline.load(tmp_path)
    with pytest.raises(IsADirectoryError, match=re.escape(
            f"Timeline.save: {tmp_path} is a directory; give the path of a file (.json, "
            f".json.gz or .png)")):
        Timeline([], "measured").save(tmp_path)
    # An empty timeline saves and loads; its chart is empty.
    assert Timeline.load(Timeline([], "measured").save(tmp_path / "e.json.gz")).slices == []
    assert (tmp_path / "e.png").exists() is False
    Timeline([], "measured").save(tmp_path / "e.png")
    assert (tmp_path / "e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, error, message", [
    (dict(slices=None), TypeError, "Timeline: slices must be an iterable of "
                                   "tfreduce.analysis.timeline.Slice, got NoneType None"),
    (dict(slices=[("tower 0", "n")]), TypeError, "Timeline: slice 0 must be a "
                                                 "tfreduce.analysis.timeline.Slice, got tuple"),
    (dict(slices=[Slice("tower x", "n", "MatMul", "forward", 0, 1)]), ValueError,
     "Timeline: slice 0 is on track 'tower x': a track is a str, \"tower <k>\" with k an int "
     "for a tower"),
    (dict(slices=[Slice("tower 0", "n", "MatMul", "forward", float("nan"), 1)]), ValueError,
     "Timeline: slice 0 ('n') starts at nan s and lasts 1 s: both must be finite numbers, the "
     "duration >= 0"),
    (dict(source=None), TypeError, "Timeline: source must be a str, got NoneType None"),
    (dict(layers={"tower0/d": -1}), ValueError, "Timeline: layers must map name scopes (str) to "
                                                "layer indices (int >= 0), got 'tower0/d': -1"),
])
def test_a_timeline_refuses_slices_and_fields_it_cannot_show(args, error, message):
    arguments = dict(slices=[], source="measured")
    arguments.update(args)
    with pytest.raises(error) as info:
        Timeline(**arguments)
    assert str(info.value).startswith(message)
