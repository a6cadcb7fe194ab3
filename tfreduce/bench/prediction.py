"""``--predict``: the cost model's times for the allreduce mode's contenders, beside the measured.

For each preset (or "host", this machine measured by a probe) every
contender's built graph is costed by ``tfreduce.predict``; the host
predictions are compared with the times measured in the same run: their
ratio, and whether they order every pair of contenders as the measurement
does (pairs within 10% of each other in either are near-ties, not counted).
"""

import itertools

from tfreduce.bench.tables import print_table
from tfreduce.costmodel import predict
from tfreduce.hostprobe import host_topology
from tfreduce.topology import Topology

__all__ = ["predict_rows", "print_predictions"]

#: Two times within this factor of each other are a near-tie.
NEAR_TIE = 1.10


def predict_rows(rows, grads, presets, num_devices, log):
    """Predicted seconds per preset and contender.

    Args:
      rows: dict name -> row of ``harness.build_contender`` (uses "outputs").
      grads: the K x N inputs the contenders reduce.
      presets: list of preset names, "host" included.
      num_devices: int K.
      log: callable(str).

    Returns:
      dict preset -> {contender: seconds}; presets with fewer devices than K
      are left out with a log line.
    """
    out = {}
    for name in presets:
        if name == "host":
            topology = host_topology(num_devices)
            edge = topology.copy_cost
            log(f"host probe: memory {topology.memory_bandwidth / 1e9:.1f} GB/s, cache-sized "
                f"ops {topology.cache[1] / 1e9:.1f} GB/s, {topology.launch_cost * 1e6:.1f} us "
                f"per op, {edge * 1e6:.1f} us per cross-device edge, "
                f"{topology.collective_cost * 1e6:.1f} us per collective member")
        else:
            topology = Topology.preset(name)
        if topology.num_devices < num_devices:
            log(f"--predict {name}: {topology.num_devices} devices, fewer than K = {num_devices}")
            continue
        out[name] = {c: predict(row["outputs"], topology, inputs=grads).seconds
                     for c, row in rows.items()}
    return out


def agreement(predicted, measured):
    """(pairs ordered alike, pairs compared): near-ties in either are left out."""
    alike = compared = 0
    for a, b in itertools.combinations(sorted(measured), 2):
        pa, pb, ma, mb = predicted[a], predicted[b], measured[a], measured[b]
        if max(ma, mb) < NEAR_TIE * min(ma, mb) or max(pa, pb) < NEAR_TIE * min(pa, pb):
            continue
        compared += 1
        alike += (pa < pb) == (ma < mb)
    return alike, compared


def print_predictions(result, out=None):
    """Prints the predicted table (ms) with the measured median and the host's ratio."""
    predictions = result.get("predictions")
    if not predictions:
        return
    measured = {r["name"]: r["median_ms"] / 1e3 for r in result["results"] if "family" in r}
    names = list(predictions)
    header = f"{'contender':30s} {'measured':>9s}" + "".join(f" {n:>11s}" for n in names)
    if "host" in predictions:
        header += f" {'host/meas.':>10s}"
    lines = []
    for c, seconds in measured.items():
        line = f"{c:30s} {seconds * 1e3:9.2f}" + "".join(
            f" {predictions[n][c] * 1e3:11.3f}" for n in names)
        if "host" in predictions:
            line += f" {predictions['host'][c] / seconds:10.2f}"
        lines.append(line)
    print_table("predicted step ms (tfreduce.predict; a model, see README) beside the measured",
                header, lines, out)
    if "host" in predictions:
        alike, compared = agreement(predictions["host"], measured)
        ratios = [predictions["host"][c] / s for c, s in measured.items()]
        print(f"host model: predicted/measured {min(ratios):.2f}-{max(ratios):.2f}; orders "
              f"{alike} of {compared} pairs (near-ties within 10% left out) as measured",
              file=out)
