"""``comm.recvs_ahead=auto``: on gloo, time both ways of posting recvs and keep the faster one.

Posting the next step's recvs before computing lets data land while the rank computes, but
each early recv-ready message wakes the peer's I/O thread, and with tiny layers that costs more
than it hides. Measured on 2 ranks, 1F1B, width 64, pipeflow took 11.3 ms a step with recvs
posted ahead and 10.0 ms with recvs posted at their step; at width 512 ahead was faster, 37.8
against 39.9 ms. Which one wins depends on the model and the machine, so ``auto`` measures it,
as ``torch.backends.cudnn.benchmark`` does for kernels:

- The first `warmup` training steps are not timed (shape negotiation, allocator warm-up).
- The next 2 x `trials` steps alternate the two settings.
- Then every rank of the group adopts the setting whose median step time is lower on the
  slowest rank. This takes one all-reduce, once. The group is the pipeline's by default; the
  trainer uses the world, so every data-parallel replica makes the same choice.
- Ahead is kept unless at-step is faster by more than `margin`.

The setting changes only when recvs are posted, never what is computed, so results are
identical whichever way it goes.
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist


class AheadTuner:
    """Chooses `Pipeline.recvs_ahead` from measured training steps (see the module docstring).

    Args:
        trials: timed steps per setting.
        warmup: untimed steps first.
        margin: relative step-time gain at-step needs over ahead to be chosen.
    """

    def __init__(self, trials: int = 10, warmup: int = 2, margin: float = 0.03) -> None:
        self.trials, self.warmup, self.margin = trials, warmup, margin
        self.choice: bool | None = None  # None until decided
        self.medians: tuple[float, float] | None = None  # (ahead, at its step), slowest rank's
        self._steps = 0
        self._times: dict[bool, list[float]] = {True: [], False: []}

    @property
    def steps_to_decide(self) -> int:
        """Training steps until the choice is made (a benchmark's warm-up should cover them)."""
        return self.warmup + 2 * self.trials

    def next_setting(self) -> bool:
        """The setting for the next training step: the choice once made, else the one to time."""
        if self.choice is not None:
            return self.choice
        return self._steps < self.warmup or len(self._times[True]) <= len(self._times[False])

    def record(self, ahead: bool, seconds: float, group: dist.ProcessGroup | None, device: torch.device) -> None:
        """Count one training step run with `ahead` that took `seconds` on this rank; after the
        last trial, agree on the choice with every rank of `group` (collective)."""
        if self.choice is not None:
            return
        self._steps += 1
        if self._steps <= self.warmup:
            return
        self._times[ahead].append(seconds)
        if min(len(t) for t in self._times.values()) < self.trials:
            return
        medians = torch.tensor([statistics.median(self._times[True]), statistics.median(self._times[False])],
                               dtype=torch.float64, device=device)
        dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=group)
        ahead_s, at_step_s = medians.tolist()
        self.medians = (ahead_s, at_step_s)
        self.choice = not at_step_s < ahead_s * (1 - self.margin)
