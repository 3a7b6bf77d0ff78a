"""What a layer costs when its stage is split over tp ranks (``parallel.tp``), from its unsplit profile.

The profile (`pipeflow.planning.profile.LayerProfile`) says what fraction of a layer's
parameters its tensor-parallel plan splits (``tp_split``, f) and what the plan's collectives
carry (``tp_forward_bytes``, ``tp_backward_bytes``, as all-reduce payloads).  Split over tp
ranks, a layer's compute and its parameter bytes scale by ``1 - f + f / tp`` (the split weights'
matmuls shrink by tp, the rest runs whole on every rank), and each action adds its collectives,
timed as ring all-reduces over the tp link: ``2 (tp - 1) / tp x bytes / bandwidth`` plus a
latency per collective (the forward's in F, the backward's input-gradient sums in B; with
sequence parallelism the same bytes move as all-gathers and reduce-scatters, and W sums the
norms' weight gradients, partial on each rank's slice of the sequence).  Activations kept
for the backward scale like the compute without sequence parallelism (the split modules' inputs
and outputs are a tp-th; the rest is whole on every rank), by 1 / tp with it, and so does what
crosses a stage boundary with it.  A model, not a measurement: `benchmarks/features/tensor_parallel.py`
measures the bytes; the link is the planner's ``plan.tp_bandwidth_gbps`` and ``plan.tp_latency_us``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipeflow.planning.profile import LayerProfile


@dataclass(frozen=True)
class TensorLink:
    """The link between the tp ranks of a stage (the GPUs of a node): bytes per second and the
    latency of one collective."""

    bandwidth_Bps: float = 150e9  # NVLink-class; the planner's plan.tp_bandwidth_gbps
    latency_s: float = 10e-6

    def all_reduce_s(self, payload_bytes: float, tp: int, collectives: int) -> float:
        """Seconds for ring all-reduces of `payload_bytes` in all over `tp` ranks, `collectives` of them."""
        if tp <= 1 or payload_bytes <= 0:
            return 0.0
        return 2 * (tp - 1) / tp * payload_bytes / self.bandwidth_Bps + collectives * self.latency_s


def split_profile(p: LayerProfile, tp: int, link: TensorLink, sequence_parallel: bool = False) -> LayerProfile:
    """Layer profile `p` as one of `tp` ranks runs it (the module docstring's model)."""
    if tp <= 1:
        return p
    scale = 1.0 - p.tp_split + p.tp_split / tp
    forward_comm = link.all_reduce_s(p.tp_forward_bytes, tp, p.tp_forward_collectives)
    backward_comm = link.all_reduce_s(p.tp_backward_bytes, tp, p.tp_backward_collectives)
    activations = p.activation_bytes / tp if sequence_parallel else p.activation_bytes * scale
    return replace(
        p,
        params=round(p.params * scale),
        param_bytes=round(p.param_bytes * scale),
        forward_s=p.forward_s * scale + forward_comm,
        backward_s=p.backward_s * scale + backward_comm,
        input_grad_s=p.input_grad_s * scale + backward_comm if p.input_grad_s else 0.0,
        # with sequence parallelism the norms' weight gradients are partial per slice: summed in W
        weight_grad_s=p.weight_grad_s * scale + (link.all_reduce_s(p.tp_norm_bytes, tp, 1) if sequence_parallel
                                                 else 0.0),
        activation_bytes=round(activations),
        output_bytes=round(p.output_bytes / tp) if sequence_parallel else p.output_bytes,
        # with cp: a tp rank's attention holds a tp-th of the heads, so of the ring's blocks
        ring_forward_bytes=round(p.ring_forward_bytes / tp), ring_backward_bytes=round(p.ring_backward_bytes / tp),
        ring_forward_hidden_s=p.ring_forward_hidden_s / tp, ring_backward_hidden_s=p.ring_backward_hidden_s / tp,
    )


def split_profiles(profiles: Sequence[LayerProfile], tp: int, link: TensorLink | None = None,
                   sequence_parallel: bool = False) -> list[LayerProfile]:
    """Every layer's profile as one of `tp` ranks runs it."""
    return [split_profile(p, tp, link or TensorLink(), sequence_parallel) for p in profiles]


def relink_profile(p: LayerProfile, tp: int, old: TensorLink, new: TensorLink,
                   sequence_parallel: bool = False) -> LayerProfile:
    """Split profile `p` (:func:`split_profile` over `old`) with its collectives costed over `new`
    instead: the measured link of its tp group in place of the assumed one."""
    if tp <= 1 or old == new:
        return p

    def delta(payload_bytes: float, collectives: int) -> float:
        return new.all_reduce_s(payload_bytes, tp, collectives) - old.all_reduce_s(payload_bytes, tp, collectives)

    forward = delta(p.tp_forward_bytes, p.tp_forward_collectives)
    backward = delta(p.tp_backward_bytes, p.tp_backward_collectives)
    norms = delta(p.tp_norm_bytes, 1) if sequence_parallel else 0.0
    return replace(
        p,
        forward_s=max(0.0, p.forward_s + forward),
        backward_s=max(0.0, p.backward_s + backward),
        input_grad_s=max(0.0, p.input_grad_s + backward) if p.input_grad_s else 0.0,
        weight_grad_s=max(0.0, p.weight_grad_s + norms),
    )


def largest_collective_bytes(profiles: Sequence[LayerProfile]) -> float:
    """The payload of the largest single tp collective the layers run (0 where none does): the
    size a start-of-run measurement of the tp link times."""
    sizes = [b / max(1, n) for p in profiles
             for b, n in ((p.tp_forward_bytes, p.tp_forward_collectives), (p.tp_backward_bytes, p.tp_backward_collectives))
             if b > 0]
    return max(sizes, default=0.0)
