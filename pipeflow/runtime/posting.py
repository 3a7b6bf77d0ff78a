"""When recvs are posted: the lowering option each pass runs (:class:`Posting`), and
``comm.post_recvs=auto``, which on gloo times both ways of posting recvs and keeps the faster.

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

from pipeflow.errors import ScheduleError
from pipeflow.schedules.lowering import POSTINGS


class AheadTuner:
    """Chooses between recvs posted ahead and at their step from measured training steps (see
    the module docstring).

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


class Posting:
    """Which lowering of the program each pass of a pipeline runs: when recvs are posted.

    A coalescing backend (NCCL) runs the ``group`` lowering: one group per step.  A backend whose
    ops complete one by one (gloo) runs ``ahead`` (recvs posted a step ahead) or ``at_step``,
    each recv waited on by its consumer; ``recvs_ahead="auto"`` times both over the first
    training steps and keeps the faster (:class:`AheadTuner`).  Results never depend on it.

    Args:
        recvs_ahead: True, False or ``"auto"`` (``comm.post_recvs``: ahead, at_step, auto; gloo only).
        lowering: a fixed lowering option instead, e.g. ``"rendezvous"`` (strict: every op of a
            step completes before its action) for debugging and before/after benchmarks.
        tuner: auto's tuner (default: 10 trials per setting after 2 untimed steps).
        agree_over_world: auto's choice is made by every rank of the world (so every
            data-parallel replica runs the same setting), not by the pipeline's ranks alone.
    """

    def __init__(
        self, recvs_ahead: bool | str = "auto", lowering: str | None = None, tuner: AheadTuner | None = None,
        agree_over_world: bool = False,
    ) -> None:
        if lowering is not None and lowering not in POSTINGS:
            raise ScheduleError(f"unknown lowering {lowering!r}; valid: {', '.join(POSTINGS)}")
        self.recvs_ahead, self.lowering = recvs_ahead, lowering
        self.tuner = tuner if tuner is not None else AheadTuner()
        self.agree_over_world = agree_over_world
        self._noted = False

    def options(self, coalescing: bool) -> tuple[str, ...]:
        """The lowering options a pipeline may run (the first until auto has chosen).

        Raises:
            ScheduleError: a lowering that posts ahead of its step on a coalescing backend,
                whose group completes only as a whole.
        """
        if coalescing and self.lowering in ("at_step", "ahead"):
            raise ScheduleError(f"lowering {self.lowering!r} needs a backend whose ops complete one by one (gloo); "
                                "NCCL runs 'group' or 'rendezvous'")
        if self.lowering is not None:
            return (self.lowering,)
        if coalescing:
            return ("group",)
        if self.recvs_ahead == "auto":
            return ("ahead", "at_step")
        return ("ahead",) if self.recvs_ahead else ("at_step",)

    def _tuning(self, coalescing: bool) -> bool:
        return len(self.options(coalescing)) > 1 and self.tuner.choice is None

    def for_training(self, coalescing: bool) -> str:
        """The lowering the next training step runs (auto: the one to time, then the choice)."""
        options = self.options(coalescing)
        if len(options) == 1:
            return options[0]
        return "ahead" if self.tuner.next_setting() else "at_step"

    def for_eval(self, coalescing: bool) -> str:
        """The lowering an evaluation pass runs: auto's choice once made, else the first option."""
        options = self.options(coalescing)
        if len(options) > 1 and self.tuner.choice is False:
            return "at_step"
        return options[0]

    def record(self, lowering: str, seconds: float, coalescing: bool, group: dist.ProcessGroup | None,
               device: torch.device) -> None:
        """Count a training step that ran `lowering` in `seconds` (collective once auto decides:
        over `group`, or the world with ``agree_over_world``)."""
        if self._tuning(coalescing):
            self.tuner.record(lowering == "ahead", seconds, None if self.agree_over_world else group, device)

    def choice_note(self) -> str | None:
        """auto's choice as one log line, the first time it is asked after the choice; else None."""
        if self._noted or self.tuner.medians is None:
            return None
        self._noted = True
        ahead_ms, at_step_ms = (1e3 * t for t in self.tuner.medians)
        where = "a step ahead" if self.tuner.choice else "at their step"
        return (f"comm.post_recvs=auto: recvs posted {where} (median step {ahead_ms:.2f} ms a step ahead, "
                f"{at_step_ms:.2f} ms at their step, slowest rank)")
