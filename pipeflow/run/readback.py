"""A training step's figures on their way to the host: the packet of the step's one all-reduce
(``[norm, loss, preempt, run directory lost, S non-finite stage flags, check_finite flags ...]``),
copied into pinned memory without waiting, and read back when the Trainer asks (a step late, in a
steady step)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipeflow.observability.metrics import StepTiming
from pipeflow.runtime.parallel.routing import RoutingFigures


@dataclass
class PendingStep:
    """A queued training step whose figures are still on the device.

    ``reduced`` is the step's all-reduced packet ``[norm, loss, preempt, run directory lost, S
    non-finite stage flags, train.check_finite flags ...]`` (float64, on the device); ``host`` is its copy on the
    host (pinned, filled asynchronously on a GPU) and ``ready`` the event recorded after that copy
    (None on the CPU, where the copy is done when it returns).
    """

    step: int
    lr: float
    reduced: torch.Tensor
    host: torch.Tensor
    ready: Any = None
    timing: StepTiming | None = None

    def values(self) -> list[float]:
        """The packet on the host: waits for this step's copy only (not for later work)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


@dataclass
class StepValues:
    """What a finished step read back: its loss, its grad norm before clipping, whether any rank
    asked to stop (``train.save_on_signal``), whether the update was skipped (fp16 overflow), and an
    MoE model's router figures (the loss includes their aux loss)."""

    loss: float
    norm: float
    preempt: bool
    overflow: bool = False
    routing: RoutingFigures | None = None
    external: bool = True  # with preempt: some rank's signal came from outside (a preemption), not its agent
    stage_norms: tuple[float, ...] = ()  # each stage's gradient norm (up to a factor alike in every step)


def packet_on_host(step: int, lr: float, packet: torch.Tensor) -> PendingStep:
    """Step `step`'s `packet` on its way to the host: on a GPU copied into pinned memory
    asynchronously with an event recorded after the copy (nothing waits now); on the CPU the
    packet itself."""
    if packet.device.type != "cuda":
        return PendingStep(step, lr, packet, packet)
    host = torch.empty(packet.shape, dtype=packet.dtype, pin_memory=True)
    host.copy_(packet, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return PendingStep(step, lr, packet, host, ready)
