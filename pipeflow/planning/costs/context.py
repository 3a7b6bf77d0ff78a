"""What context parallelism's ring (``parallel.cp``) adds to a layer's time, on a given link.

A layer profiled at a cp rank's share of the sequence (`pipeflow.planning.profile`, attending
round a :class:`~pipeflow.runtime.parallel.ring_attention.LoopbackRing`) carries its compute and, in
``ring_*`` fields, every pass its attention makes round the ring: the bytes, how many passes,
and the compute between posting each pass and waiting for it.  On a link of ``latency +
bytes / bandwidth`` per pass, what the compute does not hide is exposed:

    exposed = max(0, passes x latency + bytes / bandwidth - hidden)

once for the forward (in F) and once for the backward (in B, or in a full backward; the
attention core has no weights, so W carries none).  Summing the passes before taking the
excess lets one pass's slack hide another's excess, which is right where the passes are alike
(each ring step moves one key/value block) and optimistic by at most a pass where they are
not.  The link is the one between a stage's cp ranks: the planner's ``plan.tp_bandwidth_gbps`` and
``plan.tp_latency_us`` (a node's), a run's measured at start on its own cp group.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pipeflow.planning.profile import LayerProfile
from pipeflow.planning.costs.tensor import TensorLink


def pass_s(link: TensorLink, num_bytes: float, passes: int) -> float:
    """Seconds of `passes` passes carrying `num_bytes` in all over `link`, nothing hidden."""
    if passes <= 0:
        return 0.0
    return passes * link.latency_s + num_bytes / link.bandwidth_Bps


def exposed_s(link: TensorLink, num_bytes: float, passes: int, hidden_s: float) -> float:
    """The part of the passes' time that the compute between them does not hide."""
    return max(0.0, pass_s(link, num_bytes, passes) - hidden_s)


def ring_profile(p: LayerProfile, link: TensorLink) -> LayerProfile:
    """Layer profile `p` with its ring's exposed time over `link` added to its forward and backward."""
    forward = exposed_s(link, p.ring_forward_bytes, p.ring_forward_passes, p.ring_forward_hidden_s)
    backward = exposed_s(link, p.ring_backward_bytes, p.ring_backward_passes, p.ring_backward_hidden_s)
    if forward == 0.0 and backward == 0.0:
        return p
    return replace(p, forward_s=p.forward_s + forward, backward_s=p.backward_s + backward,
                   input_grad_s=p.input_grad_s + backward if p.input_grad_s else 0.0)


def ring_profiles(profiles: Sequence[LayerProfile], link: TensorLink) -> list[LayerProfile]:
    """Every layer's profile with its ring priced over `link` (:func:`ring_profile`)."""
    return [ring_profile(p, link) for p in profiles]


def largest_pass_bytes(profiles: Sequence[LayerProfile]) -> float:
    """The bytes of the largest single pass the layers make round the ring (0 where none does):
    the size a start-of-run measurement of the cp link times."""
    sizes = [b / n for p in profiles
             for b, n in ((p.ring_forward_bytes, p.ring_forward_passes), (p.ring_backward_bytes, p.ring_backward_passes))
             if n > 0]
    return max(sizes, default=0.0)


def ring_seconds(profiles: Sequence[LayerProfile], link: TensorLink) -> tuple[float, float]:
    """(all passes' time, the exposed part) of one micro-batch's forward and backward through
    `profiles`' layers over `link`: how much of the ring the attention compute hides."""
    total = exposed = 0.0
    for p in profiles:
        for b, n, h in ((p.ring_forward_bytes, p.ring_forward_passes, p.ring_forward_hidden_s),
                        (p.ring_backward_bytes, p.ring_backward_passes, p.ring_backward_hidden_s)):
            total += pass_s(link, b, n)
            exposed += exposed_s(link, b, n, h)
    return total, exposed
