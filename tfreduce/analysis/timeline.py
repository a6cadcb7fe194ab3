"""Timelines of a step: every op on its tower, grouped by the stage it belongs to.

A ``Timeline`` is a list of slices: one op (or transfer) on one track, with
its start and duration in seconds and the stage it belongs to. Tracks are
"tower k" (the k-th device of the towers, or of the reduction), "host" (a
device no tower uses) and, in a predicted timeline, one per link. Stages
follow the op names tfreduce builds (``stage_of``): forward and backward
(the towers' compute), then the reduction's pack, local reduce,
cross-worker, broadcast and unpack, then apply (the optimizer's update).

Two sources give the same tracks and stage names, so a measured timeline
reads beside a predicted one:

- measured: ``tfreduce.analysis.profiler.StepProfiler`` runs steps under
  TensorFlow's profiler and reads the ops it recorded.
  ``ReplicatedTrainer.fit(profile_steps=(a, b))`` and ``tfreduce-bench
  --trace FILE`` use it;
- predicted: ``tfreduce.predict(..., trace=FILE)`` writes the cost model's
  simulation of a graph on a ``Topology``.

``Timeline.save`` writes the Chrome trace event format (the JSON object
form: "X" complete events in microseconds, "M" metadata events naming each
process and thread), which Perfetto (ui.perfetto.dev) and chrome://tracing
open, or, for a path ending in ".png", a Gantt chart (matplotlib). The
layout follows Horovod's timeline: one track per worker and tower, one
slice per phase.
"""

import collections
import collections.abc
import dataclasses
import gzip
import json
import math
import numbers
import os
import re
import tempfile
import zlib

__all__ = ["COMMUNICATION", "COMPUTE", "STAGES", "Slice", "Timeline", "stage_of"]

#: The stages of a step, in the order they run.
STAGES = ("forward", "backward", "pack", "local reduce", "cross-worker", "broadcast", "unpack",
          "apply", "other")
#: Stages that compute (the towers' own work) and that communicate (the reduction).
COMPUTE = frozenset({"forward", "backward", "apply"})
COMMUNICATION = frozenset({"pack", "local reduce", "cross-worker", "broadcast", "unpack"})

_REDUCTION = re.compile(r"(^|/)(allreduce|reduce_scatter|all_gather|broadcast|reduce|"
                        r"all_to_all)_[a-z_]+/")
_BROADCAST = re.compile(r"_out(_|$|/)|bcast|broadcast|gather|concat")
_APPLY = re.compile(r"(^|/)tower\d+_apply(/|$)")
_FORWARD = re.compile(r"(^|/)tower\d+/")


def stage_of(name):
    """The stage of the op called ``name`` in a step tfreduce built (one of STAGES)."""
    if "gradient_tape/" in name:
        return "backward"
    if _APPLY.search(name):
        return "apply"
    if _REDUCTION.search(name):
        if "_unpack" in name:
            return "unpack"
        if "_pack" in name:
            return "pack"
        if "cross_worker" in name:
            return "cross-worker"
        leaf = name.rsplit("/", 1)[-1]
        return "broadcast" if _BROADCAST.search(leaf) else "local reduce"
    if _FORWARD.search(name):
        return "forward"
    return "other"


@dataclasses.dataclass(frozen=True)
class Slice:
    """One op (or transfer) on one track.

    Attributes:
      track: str, "tower k", "host" or a link between devices ("link 0->1").
      name: str, the op's name (a transfer: "tensor -> device d").
      op_type: str, the op's type ("MatMul"; "transfer", "collective").
      stage: str, one of STAGES.
      start: float seconds from the timeline's first slice.
      duration: float seconds.
    """

    track: str
    name: str
    op_type: str
    stage: str
    start: float
    duration: float

    @property
    def end(self):
        return self.start + self.duration


class Timeline:
    """Slices on tracks, measured or predicted (see the module docstring).

    Args:
      slices: iterable of Slice (any order); a "tower ..." track is
        "tower <k>", k an int.
      source: str, "measured" or "predicted: <topology>", saved with the trace.
      process: str, the name of the trace's process (one per worker).
      origin: float seconds that become time 0; None: the first slice's start.
      layers: dict {name scope: int layer index}, the scopes of the towers'
        forward ops of each layer of the model
        (``tfreduce.analysis.profiler.layer_scopes``), saved with the trace; None: {}.
      architecture: list, one [layer class name, [variable shape, ...]] per
        layer of the model the steps trained
        (``tfreduce.analysis.profiler.architecture``), saved with the trace, so a
        prediction from it can check it is given that model; None: [] (not
        known).

    Raises:
      TypeError: a slice that is no Slice, or an argument of another type.
      ValueError: a slice with an unknown stage, a "tower" track without
        its index, a start or duration that is not finite (or a negative
        duration), a negative layer index.
    """

    def __init__(self, slices, source, process="worker 0", origin=None, layers=None,
                 architecture=None):
        if isinstance(slices, (str, bytes)) or not isinstance(slices, collections.abc.Iterable):
            raise TypeError(f"Timeline: slices must be an iterable of "
                            f"tfreduce.analysis.timeline.Slice, got {type(slices).__name__} {slices!r:.80}")
        slices = list(slices)
        for i, s in enumerate(slices):
            _check_slice(s, i)
        for name, value in (("source", source), ("process", process)):
            if not isinstance(value, str):
                raise TypeError(f"Timeline: {name} must be a str, got {type(value).__name__} "
                                f"{value!r:.80}")
        if origin is not None and not _finite(origin):
            error = ValueError if isinstance(origin, numbers.Real) else TypeError
            raise error(f"Timeline: origin must be None or a finite number of seconds, got "
                        f"{origin!r}")
        if layers is not None and not isinstance(layers, dict):
            raise TypeError(f"Timeline: layers must be None or a dict {{name scope: layer "
                            f"index}}, got {type(layers).__name__} {layers!r:.80}")
        layers = dict(layers or {})
        for scope, index in layers.items():
            if (not isinstance(scope, str) or isinstance(index, bool)
                    or not isinstance(index, int) or index < 0):
                raise ValueError(f"Timeline: layers must map name scopes (str) to layer indices "
                                 f"(int >= 0), got {scope!r}: {index!r}")
        if architecture is not None and not isinstance(architecture, (list, tuple)):
            raise TypeError(f"Timeline: architecture must be None or a list, got "
                            f"{type(architecture).__name__} {architecture!r:.80}")
        architecture = list(architecture or [])
        for i, layer in enumerate(architecture):
            if not (isinstance(layer, (list, tuple)) and len(layer) == 2
                    and isinstance(layer[0], str) and isinstance(layer[1], (list, tuple))):
                raise ValueError(f"Timeline: architecture[{i}] must be [layer class name, "
                                 f"[variable shape, ...]], got {layer!r:.80}")
        slices = sorted(slices, key=lambda s: (s.start, s.track))
        if origin is None:
            origin = slices[0].start if slices else 0.0
        self.slices = [dataclasses.replace(s, start=s.start - origin) for s in slices]
        self.source = source
        self.process = process
        self.layers = layers
        self.architecture = [[name, [list(shape) for shape in shapes]]
                             for name, shapes in architecture]

    @property
    def tracks(self):
        """Track names: the towers in order, then the others by name."""
        names = {s.track for s in self.slices}
        towers = sorted((n for n in names if n.startswith("tower ")),
                        key=lambda n: int(n.split()[1]))
        return towers + sorted(names - set(towers))

    @property
    def stages(self):
        """The stages that have a slice, in STAGES order."""
        seen = {s.stage for s in self.slices}
        return [stage for stage in STAGES if stage in seen]

    def busy(self, stages):
        """float seconds during which some slice of ``stages`` runs (on any track)."""
        return _length(_union([(s.start, s.end) for s in self.slices if s.stage in stages]))

    def exposed_communication(self):
        """float seconds during which a reduction runs and no compute does.

        The part of a step that overlapping cannot hide: the union of the
        communication stages' slices minus the union of the compute stages'.
        """
        compute = _union([(s.start, s.end) for s in self.slices if s.stage in COMPUTE])
        communication = _union([(s.start, s.end) for s in self.slices
                                if s.stage in COMMUNICATION])
        return _length(communication) - _length(_intersect(communication, compute))

    def to_chrome(self):
        """The timeline as a Chrome trace event format dict (JSON object form)."""
        tids = {track: i for i, track in enumerate(self.tracks)}
        events = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
                   "args": {"name": self.process}}]
        for track, tid in tids.items():
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid,
                           "args": {"name": track}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid,
                           "args": {"sort_index": tid}})
        for s in self.slices:
            events.append({"name": s.name, "cat": s.stage, "ph": "X", "pid": 0,
                           "tid": tids[s.track], "ts": round(s.start * 1e6, 3),
                           "dur": round(s.duration * 1e6, 3), "args": {"type": s.op_type}})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"source": self.source, "stages": list(STAGES),
                              "layers": self.layers, "architecture": self.architecture}}

    @classmethod
    def load(cls, path):
        """The Timeline a ``save`` wrote as JSON, plain or gzipped (``fit``'s timeline.json.gz).

        Raises:
          OSError: the file cannot be opened or read (missing, a directory,
            no permission).
          ValueError: the file is not a whole timeline tfreduce wrote: empty
            or truncated, no JSON, no "traceEvents" and "otherData.source",
            no process name, a slice on a thread no "thread_name" event
            names, or an event without the fields ``save`` writes.
        """
        where = os.fspath(path)
        with open(path, "rb") as f:
            gzipped = f.read(2) == b"\x1f\x8b"
        try:
            with (gzip.open(path, "rt") if gzipped else open(path)) as f:
                doc = json.load(f)
        # A truncated gzip ends early (EOFError) or fails its check
        # (BadGzipFile, zlib.error); bytes that are no UTF-8 or JSON are a
        # ValueError.
        except (ValueError, EOFError, gzip.BadGzipFile, zlib.error) as error:
            raise ValueError(f"{where} is not a timeline tfreduce wrote "
                             f"({type(error).__name__}: {str(error) or 'empty or truncated'})"
                             ) from None
        try:
            return cls._from_chrome(doc)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{where} is not a timeline tfreduce wrote ({error})") from None

    @classmethod
    def _from_chrome(cls, doc):
        # The Timeline of to_chrome's dict; ValueError or TypeError saying
        # what is missing or inconsistent.
        try:
            events, other = doc["traceEvents"], doc["otherData"]
            source = other["source"]
        except (KeyError, TypeError) as error:
            raise ValueError(f"no traceEvents and otherData.source: {type(error).__name__}: "
                             f"{error}") from None
        if not isinstance(events, list) or not isinstance(other, dict):
            raise ValueError("traceEvents must be a list and otherData an object")
        names, slices = {}, []
        for i, e in enumerate(events):
            try:
                if e["ph"] == "M" and e["name"] in ("process_name", "thread_name"):
                    names[(e["name"], e["tid"])] = e["args"]["name"]
            except (KeyError, TypeError) as error:
                raise _bad_event(i, e, error) from None
        tracks = {tid: name for (kind, tid), name in names.items() if kind == "thread_name"}
        if ("process_name", 0) not in names:
            raise ValueError("no process_name event")
        for i, e in enumerate(events):
            if e.get("ph") != "X":
                continue
            try:
                if e["tid"] not in tracks:
                    raise ValueError(f"traceEvents[{i}] is on thread {e['tid']!r}, which no "
                                     f"thread_name event names")
                slices.append(Slice(tracks[e["tid"]], e["name"], e["args"]["type"], e["cat"],
                                    e["ts"] * 1e-6, e["dur"] * 1e-6))
            except (KeyError, TypeError) as error:
                raise _bad_event(i, e, error) from None
        return cls(slices, source, names[("process_name", 0)], origin=0.0,
                   layers=other.get("layers"), architecture=other.get("architecture"))

    def save(self, path):
        """Writes the Chrome trace JSON (gzipped for a ".gz" path), or a Gantt chart (".png").

        Perfetto, chrome://tracing and ``load`` read the gzipped JSON as
        they read the plain one (TensorFlow's profiler writes its trace so
        too); a step of ResNet-50 on 8 towers (38,000 ops) takes 6.2 MB as
        JSON, a tenth of that gzipped.

        The file is written whole or not at all (a temporary file renamed).

        Returns:
          str, the path.

        Raises:
          OSError: the directory cannot be made or written, or ``path``
            is a directory.
        """
        path = os.fspath(path)
        if os.path.isdir(path):
            raise IsADirectoryError(f"Timeline.save: {path} is a directory; give the path of a "
                                    f"file (.json, .json.gz or .png)")
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=directory, prefix=".timeline")
        os.close(handle)
        os.chmod(partial, 0o644)
        try:
            if path.endswith(".png"):
                self._gantt(partial)
            else:
                opener = gzip.open if path.endswith(".gz") else open
                with opener(partial, "wt") as f:
                    json.dump(self.to_chrome(), f, separators=(",", ":"))
            os.replace(partial, path)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
        return path

    def _gantt(self, path):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        tracks = self.tracks
        span = max((s.end for s in self.slices), default=0.0)
        scale, unit = (1e3, "ms") if span >= 1e-3 else (1e6, "µs")
        colours = dict(zip(STAGES, plt.get_cmap("tab10").colors))
        fig, ax = plt.subplots(figsize=(12, 0.45 * len(tracks) + 1.5))
        rows = collections.defaultdict(list)
        for s in self.slices:
            if s.op_type == "step":  # a profiled step: a line where it starts
                ax.axvline(s.start * scale, color="black", linewidth=0.8, linestyle="--")
                ax.text(s.start * scale, len(tracks) - 0.4, f" {s.name}", fontsize=8)
                continue
            rows[(s.track, s.stage)].append((s.start * scale, s.duration * scale))
        for (track, stage), bars in rows.items():
            y = len(tracks) - 1 - tracks.index(track)
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colours[stage], label=stage)
        ax.set_yticks(range(len(tracks)), tracks[::-1])
        ax.set_xlabel(unit)
        ax.set_title(f"{self.process}: {self.source}")
        shown = [stage for stage in self.stages if any(key[1] == stage for key in rows)]
        handles = dict(zip(*ax.get_legend_handles_labels()[::-1]))
        if shown:  # an empty timeline: an empty chart, no legend
            ax.legend([handles[stage] for stage in shown], shown, loc="upper center",
                      bbox_to_anchor=(0.5, -0.12 - 0.1 / max(len(tracks), 1)), ncol=len(shown),
                      frameon=False)
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100)
        plt.close(fig)


def _bad_event(i, event, error):
    # The ValueError of an event without a field save writes (KeyError), or
    # with one of another type (TypeError).
    what = (f"has no {error} field" if isinstance(error, KeyError)
            else f"has a field of another type ({error})")
    return ValueError(f"traceEvents[{i}] {what}: {event!r:.120}")


def _finite(value):
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value))


def _check_slice(s, i):
    # Raises TypeError or ValueError naming slice i, unless it is a Slice
    # the tracks, stages and times can use.
    if not isinstance(s, Slice):
        raise TypeError(f"Timeline: slice {i} must be a tfreduce.analysis.timeline.Slice, got "
                        f"{type(s).__name__} {s!r:.80}")
    if not isinstance(s.track, str) or (s.track.startswith("tower ")
                                        and not s.track[6:].isdigit()):
        raise ValueError(f"Timeline: slice {i} is on track {s.track!r}: a track is a str, "
                         f"\"tower <k>\" with k an int for a tower")
    if s.stage not in STAGES:
        raise ValueError(f"Timeline: slice {i} has stage {s.stage!r}, not one of {STAGES}")
    if not (_finite(s.start) and _finite(s.duration) and s.duration >= 0):
        raise ValueError(f"Timeline: slice {i} ({s.name!r}) starts at {s.start!r} s and lasts "
                         f"{s.duration!r} s: both must be finite numbers, the duration >= 0")


def _union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _intersect(a, b):
    # Both sorted and disjoint (from _union).
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append([start, end])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(intervals):
    return sum(end - start for start, end in intervals)
