"""What ``parallel.ep`` changes in a layer's profile: each rank holds 1/ep of the routed experts,
and every MoE layer exchanges its tokens with the other ep ranks by ``all_to_all``.

The profile is taken on one process with every expert (the tokens' compute is the same either
way: each token still runs its top_k experts, somewhere), so a stage's parameter, gradient and
optimizer bytes shrink by the experts that moved to the other ep ranks
(:func:`split_expert_profiles`), and each MoE layer's actions gain its exchanges
(:func:`with_exchanges`).  Per MoE layer and micro-batch of N tokens, one exchange moves a rank's
N x top_k rows of width C, ``top_k x output_bytes`` of the layer (its output is (B, T, C), the
width of what it sends), of which ``(ep - 1) / ep`` leave the rank, each way at once:

    F    the counts (latency only), the dispatch and the combine    2 exchanges + 3 latencies
    B    full backward: the combine's and the dispatch's reverse     2 exchanges
         split backward: the same in the input-grad half (B), and the combine's reverse once more
         in W (each layer's W walks its own graph from its output to the experts' weights)

an exchange costing ``latency + (ep - 1) / ep x bytes / bandwidth`` on the ep group's link
(:class:`ExpertLink`): an assumed NVLink-class one when the layout is chosen, replaced by the link
measured at start (:mod:`pipeflow.planning.ep_links`), or for the planner without a run the
transfer it measures between two local processes.  The activations the dispatched tokens need
are the profile's already: the experts keep the same rows for backward whether they were
gathered locally or received (the exchanges' buffers are transient).
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipeflow.models.hf_experts import hf_experts_modules, unsplittable_experts
from pipeflow.models.moe import MoE
from pipeflow.models.spec import ModelSpec
from pipeflow.planning.profile import LayerProfile

FORWARD_EXCHANGES, FORWARD_LATENCIES = 2, 3  # dispatch and combine; the counts' all_to_all is latency only
BACKWARD_EXCHANGES, WEIGHT_GRAD_EXCHANGES = 2, 1


@dataclass(frozen=True)
class ExpertLink:
    """The link between the ranks of an ep group: bytes per second leaving a rank and the latency
    of one ``all_to_all``."""

    bandwidth_Bps: float = 150e9  # NVLink-class (the ep ranks of a stage are usually one node's)
    latency_s: float = 10e-6

    def all_to_all_s(self, payload_bytes: float, ep: int, collectives: int = 1) -> float:
        """Seconds of `collectives` all_to_alls over `ep` ranks that move `payload_bytes` of a
        rank's rows in all (a share ``(ep - 1) / ep`` of them leaves it)."""
        if ep <= 1 or collectives <= 0:
            return 0.0
        return collectives * self.latency_s + (ep - 1) / ep * max(0.0, payload_bytes) / self.bandwidth_Bps


@dataclass(frozen=True)
class ExpertLayers:
    """Per layer of a model: its routed experts' parameters and its top_k (0 for a dense layer);
    and the experts parameters ``parallel.ep`` would not split (``<layer index>.<name>``)."""

    params: tuple[int, ...]
    top_k: tuple[int, ...]
    unsplit: tuple[str, ...] = ()


def layer_experts(layer: nn.Module) -> tuple[int, int, int]:
    """`layer`'s routed-expert parameters (names with ``.experts.``), the top_k of its MoE modules
    and the most routed experts of one of them (the most ways expert parallelism splits them):
    pipeflow's MoE and a Hugging Face family's experts; 0, 0, 0 for a dense layer."""
    params = sum(p.numel() for name, p in layer.named_parameters() if ".experts." in f".{name}")
    ours = [m.cfg for m in layer.modules() if isinstance(m, MoE)]
    theirs = [m for _, m in hf_experts_modules(layer)]
    top_k = sum(cfg.top_k for cfg in ours) + sum(int(getattr(m.config, "num_experts_per_tok", 0)) for m in theirs)
    counts = [cfg.experts for cfg in ours]
    counts += [p.shape[0] for m in theirs for p in m.parameters(recurse=False) if p.dim() == 3]
    return params, top_k, max(counts, default=0)


@dataclass(frozen=True)
class RoutedGemm:
    """One expert weight's matmuls for the tokens routed to its experts, routing balanced (as the
    published MoE benchmarks force it): `experts` matmuls of ``rows`` tokens each, K `k`, N `n`."""

    experts: int
    rows: float
    k: int
    n: int


@contextlib.contextmanager
def balanced_hf_experts(layer: nn.Module, record: Callable[[RoutedGemm], None],
                        elementwise: Callable[[float, float, float], None]) -> Iterator[None]:
    """While a layer runs on the meta device: each Hugging Face experts module (fused weights
    ``(experts, out, in)``, dispatched in a loop over the experts the routing hit, which on meta
    hits none) is replaced by what balanced routing computes, handed to `record` (one
    :class:`RoutedGemm` per 3-d weight), and `elementwise` gets, per call, the routed rows, the
    bytes per row its other ops move (the gated activation, the routing weights, the combine)
    and the bytes per row autograd keeps; the module returns zeros of its input's shape."""
    patched = []
    for _, module in hf_experts_modules(layer):
        top_k = int(getattr(module.config, "num_experts_per_tok", 0) or 0)
        weights = [p for name, p in module.named_parameters(recurse=False) if p.dim() == 3]
        if not top_k or not weights:
            continue

        def forward(hidden: torch.Tensor, *_: object, top_k: int = top_k, weights: list = weights) -> torch.Tensor:
            tokens = hidden.numel() // hidden.shape[-1]
            experts = weights[0].shape[0]
            for w in weights:
                record(RoutedGemm(experts, tokens * top_k / experts, int(w.shape[2]), int(w.shape[1])))
            width = hidden.shape[-1]
            inner = min(w.shape[1] * w.shape[2] // width for w in weights)  # f: gate_up 2f x h, down h x f
            size = hidden.element_size()
            # per routed row: act(gate) * up reads 2f and writes f, the routing weight and the
            # combine read and write h twice; kept: its input, gate_up's output, act's output
            elementwise(tokens * top_k, size * (3 * inner + 4 * width), size * (width + 3 * inner))
            return torch.zeros_like(hidden)

        patched.append((module, module.forward))
        module.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        for module, original in patched:
            module.forward = original  # type: ignore[method-assign]


def expert_layers(spec: ModelSpec) -> ExpertLayers:
    """Each layer's routed-expert parameters (names with ``.experts.``), the top_k of its MoE
    module (0 where it has none) and its experts parameters in no module expert parallelism splits
    (:func:`~pipeflow.models.hf_experts.unsplittable_experts`), built one layer at a time on the
    meta device."""
    params, top_k, unsplit = [], [], []
    for index in range(len(spec)):
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            layer = spec.layers[index].build()
        layer_params, layer_top_k, _ = layer_experts(layer)
        params.append(layer_params)
        top_k.append(layer_top_k)
        unsplit += [f"{index}.{name}" for name in unsplittable_experts(layer, lambda m: isinstance(m, MoE))]
    return ExpertLayers(tuple(params), tuple(top_k), tuple(unsplit))


def expert_parameter_counts(spec: ModelSpec) -> list[int]:
    """Each layer's routed-expert parameters (:func:`expert_layers`)."""
    return list(expert_layers(spec).params)


def exchange_bytes(profile: LayerProfile, top_k: int) -> float:
    """A rank's rows of one of the layer's exchanges per micro-batch: ``top_k x output_bytes``."""
    return float(top_k * profile.output_bytes)


def exchange_seconds(profile: LayerProfile, top_k: int, ep: int, link: ExpertLink) -> tuple[float, float, float]:
    """Seconds the layer's exchanges add to its (F, full or input-grad B, W) per micro-batch."""
    if ep <= 1 or top_k <= 0:
        return 0.0, 0.0, 0.0
    one = exchange_bytes(profile, top_k)
    forward = (link.all_to_all_s(FORWARD_EXCHANGES * one, ep, FORWARD_EXCHANGES)
               + (FORWARD_LATENCIES - FORWARD_EXCHANGES) * link.latency_s)
    return (forward, link.all_to_all_s(BACKWARD_EXCHANGES * one, ep, BACKWARD_EXCHANGES),
            link.all_to_all_s(WEIGHT_GRAD_EXCHANGES * one, ep, WEIGHT_GRAD_EXCHANGES))


def _add(p: LayerProfile, f: float, b: float, w: float) -> LayerProfile:
    """`p` with (f, b, w) seconds added to its forward, backward and split halves (never below 0)."""
    if not (f or b or w):
        return p
    return dataclasses.replace(
        p, forward_s=max(0.0, p.forward_s + f), backward_s=max(0.0, p.backward_s + b),
        input_grad_s=max(0.0, p.input_grad_s + b) if p.input_grad_s else 0.0,
        weight_grad_s=max(0.0, p.weight_grad_s + w) if p.input_grad_s or p.weight_grad_s else 0.0)


def with_exchanges(profiles: Sequence[LayerProfile], top_k: Sequence[int], ep: int,
                   link: ExpertLink | None = None) -> list[LayerProfile]:
    """The profiles with every MoE layer's exchanges over `ep` ranks costed on `link` (the module
    docstring's model; the assumed :class:`ExpertLink` when None)."""
    link = link or ExpertLink()
    return [_add(p, *exchange_seconds(p, k, ep, link)) for p, k in zip(profiles, top_k)]


def relink_exchanges(profiles: Sequence[LayerProfile], top_k: Sequence[int], ep: int, old: ExpertLink,
                     new: ExpertLink) -> list[LayerProfile]:
    """Profiles costed by :func:`with_exchanges` over `old`, with their exchanges on `new` instead
    (the ep group's link measured at start in place of the assumed one)."""
    if ep <= 1 or old == new:
        return list(profiles)
    out = []
    for p, k in zip(profiles, top_k):
        was, now = exchange_seconds(p, k, ep, old), exchange_seconds(p, k, ep, new)
        out.append(_add(p, *(b - a for a, b in zip(was, now))))
    return out


def split_expert_profiles(profiles: Sequence[LayerProfile], expert_params: Sequence[int], ep: int) -> list[LayerProfile]:
    """The profiles as one ep rank holds the layers: ``expert_params[i] (1 - 1/ep)`` parameters fewer."""
    out = []
    for profile, experts in zip(profiles, expert_params):
        gone = experts - experts // ep
        if not gone or not profile.params:
            out.append(profile)
            continue
        kept = profile.params - gone
        out.append(dataclasses.replace(profile, params=kept, param_bytes=round(profile.param_bytes * kept / profile.params)))
    return out


def expert_profiles(profiles: Sequence[LayerProfile], layers: ExpertLayers, ep: int,
                    link: ExpertLink | None = None) -> list[LayerProfile]:
    """The profiles as one of `ep` ranks runs them: its share of the experts' parameters and the
    layers' exchanges on `link` (:func:`split_expert_profiles`, :func:`with_exchanges`)."""
    if ep <= 1:
        return list(profiles)
    return with_exchanges(split_expert_profiles(profiles, layers.params, ep), layers.top_k, ep, link)


def exchange_payload(profiles: Sequence[LayerProfile], top_k: Sequence[int]) -> float:
    """The largest single exchange of the layers (a rank's rows, bytes; 0 for a dense model): the
    size a start-of-run measurement of the ep link times."""
    return max((exchange_bytes(p, k) for p, k in zip(profiles, top_k) if k > 0), default=0.0)


def exchanged_bytes_per_step(profiles: Sequence[LayerProfile], top_k: Sequence[int], ranges: Sequence[range],
                             ep: int, microbatches: int) -> list[float]:
    """Per stage, the bytes its exchanges send off each rank in a training step: per MoE layer
    and micro-batch ``(ep - 1) / ep x exchange`` each way, twice forward and twice backward."""
    if ep <= 1:
        return [0.0 for _ in ranges]
    per = (FORWARD_EXCHANGES + BACKWARD_EXCHANGES) * (ep - 1) / ep * microbatches
    return [per * sum(exchange_bytes(profiles[i], top_k[i]) for i in layers) for layers in ranges]
