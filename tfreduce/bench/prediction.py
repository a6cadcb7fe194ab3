"""``--predict``: the cost model's times for the allreduce mode's contenders, beside the measured.

For each preset (or "host", this machine measured by a probe) every
contender's built graph is costed by ``tfreduce.predict``; the host
predictions, plus the run's "inputs" row, are compared with the step times
measured in the same run: their ratio, and whether they order every pair
of contenders as the measurement does (pairs within 10% of each other in
either are near-ties, not counted).
"""

import itertools

from tfreduce.analysis.costmodel import predict
from tfreduce.analysis.hostprobe import host_topology
from tfreduce.basis.topology import Topology
from tfreduce.bench.tables import print_table

__all__ = ["host_check", "predict_rows", "print_predictions"]

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
            fresh = topology.fresh_memory
            log(f"host probe: memory {topology.memory_bandwidth / 1e9:.1f} GB/s, cache-sized "
                f"ops {topology.cache[1] / 1e9:.1f} GB/s, {topology.launch_cost * 1e6:.1f} us "
                f"per op, {edge * 1e6:.1f} us per cross-device edge, "
                f"{topology.collective_cost * 1e6:.1f} us per collective member, "
                f"{topology.compute_lanes} lanes, outputs above 32 MiB "
                + ("free" if fresh is None else f"{fresh[1] / 1e9:.1f} GB/s to map"))
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


def host_check(predictions, results):
    """How the host model's step times compare with the measured ones.

    The model times a reduction from inputs that are ready; a measured step
    also reads the inputs and runs the graph, which this run's "inputs" row
    times (a step that only reads them): the host's predicted step is the
    prediction plus that row.

    Args:
      predictions: dict preset -> {contender: seconds}, from predict_rows.
      results: the allreduce mode's result rows (median_ms per row).

    Returns:
      None without a "host" prediction, else a dict: inputs_ms, step_ms
      (contender -> predicted step ms), ratios (contender -> predicted /
      measured), within_1_5 (how many ratios lie in [1/1.5, 1.5]), ordered
      and compared (pairs of contenders ordered as measured, of those that
      are not near-ties).
    """
    if "host" not in predictions:
        return None
    medians = {r["name"]: r["median_ms"] / 1e3 for r in results}
    measured = {r["name"]: medians[r["name"]] for r in results if "family" in r}
    step = {c: predictions["host"][c] + medians["inputs"] for c in measured}
    ratios = {c: step[c] / seconds for c, seconds in measured.items()}
    alike, compared = agreement(step, measured)
    return {"inputs_ms": 1e3 * medians["inputs"], "step_ms": {c: 1e3 * s for c, s in step.items()},
            "ratios": ratios, "within_1_5": sum(1 / 1.5 <= r <= 1.5 for r in ratios.values()),
            "ordered": alike, "compared": compared}


def print_predictions(result, out=None):
    """Prints the predicted table (ms) with the measured median and the host's ratio."""
    predictions = result.get("predictions")
    if not predictions:
        return
    measured = {r["name"]: r["median_ms"] / 1e3 for r in result["results"] if "family" in r}
    check = result.get("host_check")
    names = list(predictions)
    header = f"{'contender':30s} {'measured':>9s}" + "".join(f" {n:>11s}" for n in names)
    if check:
        header += f" {'host step':>10s} {'host/meas.':>10s}"
    lines = []
    for c, seconds in measured.items():
        line = f"{c:30s} {seconds * 1e3:9.2f}" + "".join(
            f" {predictions[n][c] * 1e3:11.3f}" for n in names)
        if check:
            line += f" {check['step_ms'][c]:10.3f} {check['ratios'][c]:10.2f}"
        lines.append(line)
    print_table("predicted step ms (tfreduce.predict; a model, see README) beside the measured",
                header, lines, out)
    if check:
        ratios = check["ratios"].values()
        print(f"host model (a step = the prediction + the inputs row, {check['inputs_ms']:.2f} "
              f"ms): predicted/measured {min(ratios):.2f}-{max(ratios):.2f}, "
              f"{check['within_1_5']} of {len(check['ratios'])} within 1.5x; orders "
              f"{check['ordered']} of {check['compared']} pairs (near-ties within 10% left out) "
              f"as measured", file=out)
