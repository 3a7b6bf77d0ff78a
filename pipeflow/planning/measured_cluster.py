"""What a run measured, put over a cluster preset's figures (``plan.hardware=<preset>
plan.calibration=<run dir>``): the links the run timed at start and its per-layer profile.

A run records both in its ``costs.json`` (`pipeflow.planning.calibration`, the ``meta`` the
builder writes): ``links``, each link it timed at start (:func:`start_links`: every pair of
pipeline ranks where the job spans hosts, else the pipeline group's ring; each tp group's
all-reduce), with the global ranks and hosts at its ends; ``hosts``, each global rank's host;
``profiles``, every layer timed alone at the run's micro-batch size; ``seq_len`` and ``tp``.

- Links (:func:`measured_links`): those whose ends share a host give ``intra``, those across
  hosts ``inter``; the median latency and the median per-byte cost of each class.  A measured
  figure is what transfers *reached*, while the roofline reaches ``Efficiency.network`` of a
  preset's (peak) bandwidth: the measured bandwidth enters divided by it, so the planner costs a
  transfer as the run timed it.  A class the run did not time stays the preset's.
- Layers (:func:`measured_layers`): a planned layer whose kind (its name, digits aside) and
  parameter count match layers of the profile takes their measured forward and backward (mean
  over those layers) as two factors over the roofline's compute at the profile's micro-batch
  size and tp = 1: ``measured / roofline``.  The roofline then scales them with the micro-batch
  size and tp as it scales its own (matmul efficiency by size, a tp-th of the split work); tp's
  collectives are added on the links, unscaled.  B and W share the backward's factor (a profile
  splits the backward only for some schedules, and an embedding's halves differ from the
  roofline's).  A profile of another sequence length, or one split for tp by a model rather
  than measured (``tp`` > 1), is ignored, and so is every layer that matches none: each with a
  line that says so.  The factors are the measured machine's: a profile taken on a CPU makes
  the planned GPUs as slow as that CPU, which the header says too.
"""
from __future__ import annotations

import math
import platform
import re
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from pipeflow.planning.hardware import Cluster, Link, override
from pipeflow.planning.costs.layer_trace import LayerShape
from pipeflow.planning.costs.roofline import Efficiency, Placement, layer_profile


def start_links(costs: Any, pipelines: Sequence[Sequence[int]], host_names: Sequence[str]) -> list[dict[str, Any]]:
    """The links a run timed at start (`costs`: its :class:`~pipeflow.planning.step_model.StepCosts`,
    None where it measured none), as ``costs.json`` keeps them: every pair of pipeline ranks
    where the job spans hosts, else the first pipeline's ring, and with tp > 1 every tp group's
    all-reduce; each with its global ranks and their hosts (`host_names`: per global rank),
    ``latency_s`` and ``per_byte_s`` (a pair of pipeline ranks also its ``burst_bytes``)."""
    if costs is None or not pipelines:
        return []
    # tp > 1: each tp group's ring all-reduce (bytes over its bus bandwidth, as the roofline's collectives)
    tp_groups = [{"what": "a tp group's all-reduce", "ranks": list(ranks), "hosts": [host_names[r] for r in ranks],
                  "latency_s": link.latency_s, "per_byte_s": 1.0 / link.bandwidth_Bps}
                 for ranks, link in getattr(getattr(costs, "tp_links", None), "groups", ())]
    if costs.links is not None:
        return [{"what": f"pipeline ranks {link.ranks[0]}-{link.ranks[1]}", "ranks": list(link.global_ranks),
                 "hosts": [host_names[r] for r in link.global_ranks], "latency_s": link.latency_s,
                 "per_byte_s": link.per_byte_s, "burst_bytes": link.burst_bytes} for link in costs.links.links] + tp_groups
    ring = list(pipelines[0])
    if len(ring) < 2 or (costs.latency_s <= 0 and costs.per_byte_s <= 0):
        return tp_groups
    return [{"what": "the pipeline ring", "ranks": ring, "hosts": [host_names[r] for r in ring],
             "latency_s": costs.latency_s, "per_byte_s": costs.per_byte_s}, *tp_groups]


def rank_hosts(world: int) -> list[str]:
    """Each global rank's host name (the job's host table; on one host, this host's name)."""
    from pipeflow.runtime.world import hosts

    table = hosts.table()
    names = [platform.node()] * world
    for name, _, ranks in table.hosts:
        for r in ranks:
            if r < world:
                names[r] = name
    return names


def measured_links(links: Sequence[Mapping[str, Any]], eff: Efficiency = Efficiency()) -> dict[str, tuple[Link, str]]:
    """``intra`` and ``inter`` as a run's recorded `links` measured them (those it timed), each
    with the links it came from: the median latency and per-byte cost of the links within one
    host and of those across hosts, the bandwidth over ``eff.network`` (module docstring)."""
    classes: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for link in links:
        classes["intra" if len(set(link["hosts"])) == 1 else "inter"].append(link)
    out = {}
    for kind, group in classes.items():
        latency = statistics.median(float(x["latency_s"]) for x in group)
        per_byte = statistics.median(float(x["per_byte_s"]) for x in group)
        gbps = 1.0 / (per_byte * 1e9) / eff.network if per_byte > 0 else math.nan
        hosts = sorted({h for x in group for h in x["hosts"]})
        what = ", ".join(f"{x['what']} (global ranks {'-'.join(str(r) for r in x['ranks'][:2])}"
                         f"{'...' if len(x['ranks']) > 2 else ''})" for x in group[:3])
        what += f"{' and more' if len(group) > 3 else ''} on {', '.join(hosts)}"
        out[kind] = (Link(gbps, latency * 1e6), what)
    return out


def with_measured_links(cluster: Cluster, links: Sequence[Mapping[str, Any]], where: str,
                        eff: Efficiency = Efficiency()) -> tuple[Cluster, list[str]]:
    """`cluster` with the links a run measured in place of its own (:func:`measured_links`), and a
    line per link saying where its figures came from (`where`: the run directory)."""
    measured = measured_links(links, eff)
    lines = []
    for kind, label in (("intra", "within a host"), ("inter", "between hosts")):
        preset = getattr(cluster, kind)
        was = f"{preset.bandwidth_gbps:g} GB/s, {preset.latency_us:g} us"
        if kind not in measured:
            lines.append(f"{label}: {was} from {cluster.name} (the run in {where} timed no link "
                         f"{'within a host' if kind == 'intra' else 'across hosts'})")
            continue
        link, what = measured[kind]
        figures = {}  # a figure the fit left at 0 (clipped: not resolved) stays the preset's
        if link.latency_us > 0:
            figures[f"{kind}.latency_us"] = link.latency_us
        if math.isfinite(link.bandwidth_gbps):
            figures[f"{kind}.bandwidth_gbps"] = link.bandwidth_gbps
        cluster = override(cluster, figures)
        rate = (f"{link.bandwidth_gbps * eff.network:.3g} GB/s reached (counted as {link.bandwidth_gbps:.3g} at "
                f"network efficiency {eff.network:g})" if math.isfinite(link.bandwidth_gbps)
                else f"no per-byte cost resolved: {preset.bandwidth_gbps:g} GB/s from {cluster.name}")
        latency = (f"{link.latency_us:.3g} us" if link.latency_us > 0
                   else f"no latency resolved: {preset.latency_us:g} us from {cluster.name}")
        lines.append(f"{label}: measured at start by the run in {where}, {what}: {rate}, {latency} "
                     f"(the preset's: {was})")
    return cluster, lines


def layer_kind(name: str) -> str:
    """A layer's kind: its name with the digits of its index put aside (``block.7`` -> ``block.#``)."""
    return re.sub(r"\d+", "#", name)


def measured_layers(shapes: Sequence[LayerShape], meta: Mapping[str, Any], cluster: Cluster, dtype: str,
                    seq_len: int, where: str, eff: Efficiency = Efficiency()) -> tuple[list[LayerShape], list[str]]:
    """`shapes` with the factors of the layers the run's profile measured (module docstring), and
    the lines that say which layers are measured, which are not and why."""
    profiles = meta.get("profiles")
    machine = meta.get("machine", {})
    if not profiles:
        return list(shapes), [f"layer costs: the roofline's (the run in {where} recorded no per-layer profile: "
                              "run it with pipeline.profile=true)"]
    run_seq, tp0 = meta.get("seq_len"), int(meta.get("tp") or 1)
    if run_seq is not None and int(run_seq) != seq_len:
        return list(shapes), [f"layer costs: the roofline's; the profile in {where} is ignored: it was taken at "
                              f"data.seq_len={run_seq}, this plan is at {seq_len}"]
    if tp0 > 1:
        return list(shapes), [f"layer costs: the roofline's; the profile in {where} is ignored: that run had "
                              f"parallel.tp={tp0}, whose per-layer profile is split by a model, not measured"]
    b0 = int(meta["microbatch_size"])
    groups: dict[tuple[str, int], list[Mapping[str, Any]]] = defaultdict(list)
    for p in profiles:
        groups[layer_kind(p["name"]), int(p["params"])].append(p)
    out, factors, missing = [], {}, []
    for shape in shapes:
        key = (layer_kind(shape.name), shape.params)
        if key not in groups:
            out.append(shape)
            missing.append(shape.name)
            continue
        if key not in factors:
            factors[key] = _factors(shape, groups[key], b0, cluster, dtype, eff)
        out.append(replace(shape, measured=factors[key]))
    if not factors:
        return list(shapes), [f"layer costs: the roofline's; the profile in {where} is ignored: none of its layers "
                              f"({', '.join(sorted({layer_kind(p['name']) for p in profiles}))}) has the kind and "
                              "parameter count of a layer of this model: profile a run of this model (or of one "
                              "with the same widths)"]
    device = f"{machine.get('device_name') or machine.get('device', '?')}, host {machine.get('host', '?')}"
    said = "; ".join(f"{kind}: forward {f:.3g}x, backward {b:.3g}x" for (kind, _), (f, b) in factors.items())
    lines = [f"layer costs: {len(shapes) - len(missing)} of {len(shapes)} layers from the per-layer profile in {where} "
             f"(micro-batch {b0}, {meta.get('dtype', '?')} on {device}), as factors over the roofline's compute "
             f"({said}), scaled in micro-batch size and tp as the roofline scales"]
    if missing:
        lines.append(f"layer costs of {_names(missing)}: the roofline's (no layer of their kind and size in the profile)")
    family, name = cluster.gpu.name.split("-")[0], machine.get("device_name") or machine.get("device") or "?"
    if machine.get("device") == "cpu" or family.lower() not in name.lower():
        lines.append(f"note: that profile was taken on {'a CPU' if machine.get('device') == 'cpu' else name}, not "
                     f"on {cluster.gpu.name}: the plan is for GPUs as fast as that (profile on the GPUs you plan for)")
    return out, lines


def _factors(shape: LayerShape, measured: Sequence[Mapping[str, Any]], b0: int, cluster: Cluster, dtype: str,
             eff: Efficiency) -> tuple[float, float]:
    """(forward, backward) of `measured` (their mean) over the roofline's compute of `shape` at b0, tp = 1."""
    roof = layer_profile(replace(shape, measured=None), b0, Placement(dtype=dtype), cluster, eff)
    forward = statistics.fmean(float(p["forward_s"]) for p in measured)
    # the whole backward where timed, else its two halves (a profile of a split-backward schedule)
    backward = statistics.fmean(float(p["backward_s"]) or float(p.get("input_grad_s") or 0.0)
                                + float(p.get("weight_grad_s") or 0.0) for p in measured)
    roof_backward = roof.input_grad_s + roof.weight_grad_s
    return (forward / roof.forward_s if forward > 0 and roof.forward_s > 0 else 1.0,
            backward / roof_backward if backward > 0 and roof_backward > 0 else 1.0)


def _names(names: Sequence[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:3])} and {len(names) - 3} more"
