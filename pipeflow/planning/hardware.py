"""The cluster description as data: hosts, GPUs per host, the links within and between hosts, and
each GPU's peak FLOP/s, memory size and bandwidth (``plan.hardware=<preset id or YAML file>``).

Presets (vendors' published figures, cited in each file) ship in ``pipeflow/planning/hardware/``:
``a100_sxm_80gb``, ``h100_sxm``, ``h200_sxm``, ``b200``.  Beside its peaks each names the fastest a
large matmul was measured to run on the GPU (``gpu.matmul_tflops``: the Maximum Achievable Matmul
FLOPS table of Bekman's ml-engineering, cited in the file).  The faster the GPU, the less of its
peak it reaches (A100 86.9%, H100 80.3%, B200 77.6%): the planner's matmul efficiency, fitted on
one generation, is a fraction of that measured rate, so it carries to another.  A YAML file of the
same shape describes any other cluster; figures measured on the machines (the links measured at
start, a per-layer profile) replace a preset's with :func:`override`::

    cluster = load_hardware("h100_sxm")
    cluster = override(cluster, {"inter.bandwidth_gbps": 42.0, "hosts": 32})
    link = cluster.group_link(ranks=[0, 8, 16, 24])   # a dp group across 4 hosts: the inter link

Units: bandwidths in GB/s (1e9 bytes/s) each way per GPU, latencies in microseconds, FLOP/s in
TFLOP/s dense (not 2:4 sparse), memory in GB (1e9 bytes).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeflow.errors import ConfigError

PRESET_DIR = Path(__file__).resolve().parent / "hardware"
# NCCL's own latency model of a ring collective (src/graph/tuning.cc, the Simple protocol it runs
# for MB-sized buckets and FSDP units), microseconds: a base, and each step's latency within a
# host (NVLink) and across hosts (the network)
RING_BASE_US = 8.4
RING_STEP_US = {"intra": 3.4, "inter": 14.0}
# a GPU described without gpu.matmul_tflops.<dtype> is taken to reach this fraction of its peak in a
# large matmul: Hopper's measured 80.3% (H100 and H200; A100 86.9%, B200 77.6%)
UNMEASURED_MATMUL_FRACTION = 0.8


@dataclass(frozen=True)
class Link:
    """One kind of link: GB/s each way per GPU, and the latency of one transfer or collective."""

    bandwidth_gbps: float
    latency_us: float = 10.0

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move `nbytes` one way over this link (latency + bytes / bandwidth)."""
        return self.latency_us * 1e-6 + nbytes / (self.bandwidth_gbps * 1e9)


@dataclass(frozen=True)
class Gpu:
    """One accelerator: dense peak TFLOP/s per dtype (``bf16``, ``fp16``, ``fp8``, ``fp32``, ...),
    memory in GB and its bandwidth in GB/s, and the TFLOP/s a large matmul was measured to reach
    per dtype (``matmul_tflops``, where measured)."""

    name: str
    peak_tflops: Mapping[str, float]
    memory_gb: float
    memory_bandwidth_gbps: float
    matmul_tflops: Mapping[str, float] = field(default_factory=dict)

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s in `dtype` (``bf16``, ``fp16``, ``fp8``, ``fp32``).

        Raises:
            ConfigError: the GPU has no figure for `dtype`.
        """
        if dtype not in self.peak_tflops:
            raise ConfigError(f"the {self.name} description has no peak for {dtype!r} (it has "
                              f"{', '.join(self.peak_tflops)}): add gpu.peak_tflops.{dtype} to the hardware file")
        return float(self.peak_tflops[dtype]) * 1e12

    def matmul_flops(self, dtype: str) -> float:
        """FLOP/s the fastest large matmul reaches in `dtype`: the measured figure (at most the
        peak, which an override may have lowered), else :data:`UNMEASURED_MATMUL_FRACTION` of it.

        Raises:
            ConfigError: the GPU has no peak for `dtype`.
        """
        peak = self.peak_flops(dtype)
        if dtype in self.matmul_tflops:
            return min(peak, float(self.matmul_tflops[dtype]) * 1e12)
        return UNMEASURED_MATMUL_FRACTION * peak


@dataclass(frozen=True)
class Cluster:
    """Hosts of `gpus_per_host` GPUs; `intra` joins the GPUs of a host, `inter` the hosts.

    Attributes:
        hosts: how many hosts (None: as many as a layout needs).
        gpus_per_host: GPUs (ranks) per host; global rank r is on host ``r // gpus_per_host``.
        intra: the link between two GPUs of one host (NVLink/NVSwitch), per GPU each way.
        inter: the link between hosts (InfiniBand/Ethernet), per GPU each way (one NIC per GPU).
        gpu: what each GPU computes and holds.
        name: the preset id or file it came from.
    """

    hosts: int | None
    gpus_per_host: int
    intra: Link
    inter: Link
    gpu: Gpu
    name: str = field(default="custom", compare=False)

    def host_of(self, rank: int) -> int:
        """The host of global rank `rank` (ranks fill hosts in order)."""
        return rank // self.gpus_per_host

    def group_link(self, ranks: Sequence[int]) -> Link:
        """The link a collective (or a pair's transfer) among `ranks` runs at: `intra` within one
        host; across hosts, a ring crosses each host once per NIC, so the group's k ranks on a
        host share k NICs: ``min(intra, k x inter)`` GB/s each way, at the inter latency."""
        hosts: dict[int, int] = {}
        for r in ranks:
            hosts[self.host_of(r)] = hosts.get(self.host_of(r), 0) + 1
        if len(hosts) <= 1:
            return self.intra
        per_host = min(hosts.values())
        return Link(min(self.intra.bandwidth_gbps, per_host * self.inter.bandwidth_gbps), self.inter.latency_us)

    def ring_latency_s(self, ranks: Sequence[int]) -> float:
        """Seconds of latency of one ring all-gather or reduce-scatter among `ranks`, as NCCL
        models it: a base plus each of its n - 1 steps' latency, hosts - 1 of them across hosts
        (:data:`RING_STEP_US`).  Apart from the bytes' time: over 512 ranks it is milliseconds,
        paid by each FSDP unit's collectives."""
        n, hosts = len(ranks), len({self.host_of(r) for r in ranks})
        if n <= 1:
            return 0.0
        return (RING_BASE_US + (n - hosts) * RING_STEP_US["intra"] + (hosts - 1) * RING_STEP_US["inter"]) * 1e-6


def preset_ids() -> list[str]:
    """The preset ids shipped with pipeflow."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_hardware(spec: str) -> Cluster:
    """The cluster `spec` names: a preset id (:func:`preset_ids`) or the path of a YAML file with
    ``gpus_per_host``, ``intra``/``inter`` (``bandwidth_gbps``, ``latency_us``), ``gpu`` (``name``,
    ``peak_tflops``, ``memory_gb``, ``memory_bandwidth_gbps``, optionally ``matmul_tflops``: what
    ml-engineering's ``mamf-finder.py`` measures on the GPU) and optionally ``hosts``.

    Raises:
        ConfigError: neither a preset nor a readable file, or a field missing or not positive.
    """
    path = PRESET_DIR / f"{spec}.yaml"
    if not path.is_file():
        path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(f"plan.hardware={spec!r} is neither a preset ({', '.join(preset_ids())}) nor a YAML file")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"plan.hardware={spec!r}: cannot read {path}: {err}") from err
    return cluster_from_dict(data, str(spec))


def cluster_from_dict(data: Mapping[str, Any], name: str = "custom") -> Cluster:
    """A :class:`Cluster` from a mapping shaped like the preset files.

    Raises:
        ConfigError: a field missing, of the wrong kind, or not positive (named with its path).
    """
    def need(where: Mapping[str, Any], key: str, path: str) -> Any:
        if not isinstance(where, Mapping) or key not in where:
            raise ConfigError(f"hardware {name!r}: {path}{key} is missing")
        return where[key]

    def positive(value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"hardware {name!r}: {path}={value!r} must be a positive number")
        return float(value)

    def link(key: str) -> Link:
        raw = need(data, key, "")
        return Link(positive(need(raw, "bandwidth_gbps", f"{key}."), f"{key}.bandwidth_gbps"),
                    positive(raw.get("latency_us", 10.0), f"{key}.latency_us"))

    def measured_matmul(raw: Any, peaks: Mapping[str, float]) -> dict[str, float]:
        """``gpu.matmul_tflops`` checked: a positive figure per dtype that has a peak, and at most it."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"hardware {name!r}: gpu.matmul_tflops must map dtypes (bf16, fp8, ...) to the "
                              "TFLOP/s a large matmul was measured to reach")
        measured = {str(k): positive(v, f"gpu.matmul_tflops.{k}") for k, v in raw.items()}
        for dtype, value in measured.items():
            if dtype not in peaks:
                raise ConfigError(f"hardware {name!r}: gpu.matmul_tflops.{dtype} is given but gpu.peak_tflops.{dtype} "
                                  "is not: add the peak")
            if value > peaks[dtype]:
                raise ConfigError(f"hardware {name!r}: gpu.matmul_tflops.{dtype}={value:g} exceeds gpu.peak_tflops."
                                  f"{dtype}={peaks[dtype]:g}: a matmul cannot beat the dense peak; check the dtype and "
                                  "that the peak is dense (not 2:4 sparse)")
        return measured

    raw_gpu = need(data, "gpu", "")
    peaks = need(raw_gpu, "peak_tflops", "gpu.")
    if not isinstance(peaks, Mapping) or not peaks:
        raise ConfigError(f"hardware {name!r}: gpu.peak_tflops must map dtypes (bf16, fp16, ...) to TFLOP/s")
    peak_tflops = {str(k): positive(v, f"gpu.peak_tflops.{k}") for k, v in peaks.items()}
    gpu = Gpu(str(need(raw_gpu, "name", "gpu.")), peak_tflops,
              positive(need(raw_gpu, "memory_gb", "gpu."), "gpu.memory_gb"),
              positive(need(raw_gpu, "memory_bandwidth_gbps", "gpu."), "gpu.memory_bandwidth_gbps"),
              measured_matmul(raw_gpu.get("matmul_tflops", {}), peak_tflops))
    hosts = data.get("hosts")
    gpus = positive(need(data, "gpus_per_host", ""), "gpus_per_host")
    return Cluster(None if hosts is None else int(positive(hosts, "hosts")), int(gpus), link("intra"), link("inter"),
                   gpu, str(data.get("name", name)))


def override(cluster: Cluster, figures: Mapping[str, Any]) -> Cluster:
    """`cluster` with the fields named by dotted keys replaced by measured (or chosen) figures,
    e.g. ``{"intra.bandwidth_gbps": 140.0, "inter.latency_us": 8.0, "gpu.memory_gb": 40, "hosts": 4,
    "gpu.peak_tflops.bf16": 700}``.

    Raises:
        ConfigError: a key that names no field.
    """
    for key, value in figures.items():
        cluster = _replace_path(cluster, key.split("."), value, key)
    return cluster


def _replace_path(obj: Any, path: list[str], value: Any, key: str) -> Any:
    head, rest = path[0], path[1:]
    if isinstance(obj, Mapping):
        if not rest:
            return {**obj, head: float(value)}
        raise ConfigError(f"hardware override {key!r}: {head} is a number, not a group")
    names = {f.name for f in dataclasses.fields(obj)}
    if head not in names:
        raise ConfigError(f"hardware override {key!r}: {type(obj).__name__} has no field {head!r} "
                          f"(fields: {', '.join(sorted(names))})")
    new = value if not rest else _replace_path(getattr(obj, head), rest, value, key)
    return dataclasses.replace(obj, **{head: new})
