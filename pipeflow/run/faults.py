"""Fault injection for tests and drills: ``PIPEFLOW_FAULT_INJECT=<kind>:rank=R:step=K[:microbatch=I][:stage=S][:attempt=A]``.

The variable is read in one place (:func:`install_from_env`, called by the Trainer); unset,
nothing is installed.  On global rank R, the forward of micro-batch I (default 0) of training
step K on this rank's first stage (or stage S) then:

=========  =====================================================================
stall      sleeps for an hour (a rank hung inside forward)
raise      raises RuntimeError (an exception in a user's layer)
kill       sends itself SIGKILL (a process that dies mid-step)
oom        raises torch.OutOfMemoryError (CUDA out of memory)
shape      returns outputs whose first dimension is halved
dtype      returns outputs in another floating dtype
nan        returns outputs filled with NaN (floating ones)
overflow   leaves the outputs finite but makes their gradient inf in backward (an
           fp16 gradient overflow: the loss scaler skips the step, the loss stays finite)
hold       waits while the file that ``PIPEFLOW_FAULT_HOLD`` names exists (at most an
           hour): the job held at a known step while a test or drill acts on it (a host
           joins), released the moment the file is removed; its peers wait for it at most
           ``comm.timeout_s``, so set that above the hold
slow       from step K on, every forward of the stage first sleeps ms=M milliseconds (a rank
           whose compute slowed: a straggler for ``metrics.straggler_factor``)
spike      on the last stage (give stage=S): multiplies the micro-batch's loss by 30, the
           reported one and the one backward starts from; once per process: a loss spike
           for ``train.spike`` (a rolled-back run passes step K again unharmed)
=========  =====================================================================

With ``attempt=A`` the fault fires only in launch A of a relaunch loop (``PIPEFLOW_ATTEMPT``,
which examples/relaunch.sh sets: 0, 1, ...; unset counts as 0), so that a drill's restart can
get past it.  A rank R that the job does not have is a ConfigError.

Each injection prints ``[pipeflow fault injection] ... t=<unix time>`` to stderr first, so a
test can measure how long the job took to stop.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from pipeflow.errors import ConfigError

ENV_VAR = "PIPEFLOW_FAULT_INJECT"
ATTEMPT_VAR = "PIPEFLOW_ATTEMPT"
HOLD_VAR = "PIPEFLOW_FAULT_HOLD"
KINDS = ("stall", "raise", "kill", "oom", "shape", "dtype", "nan", "overflow", "hold", "spike", "slow")
SPIKE_FACTOR = 30.0
STALL_S = 3600.0


@dataclass(frozen=True)
class FaultSpec:
    """Which fault to inject, where and when."""

    kind: str
    rank: int
    step: int
    microbatch: int = 0
    stage: int | None = None
    attempt: int | None = None
    ms: int = 0  # slow: the sleep before every forward

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """Parse ``kind:rank=R:step=K[:microbatch=I][:stage=S][:attempt=A][:ms=M]``.

        Raises:
            ConfigError: an unknown kind or field, or a missing rank or step.
        """
        kind, *fields = text.strip().split(":")
        if kind not in KINDS:
            raise ConfigError(f"{ENV_VAR}={text!r}: unknown fault {kind!r}; valid: {', '.join(KINDS)}")
        values: dict[str, int] = {}
        for field in fields:
            key, _, value = field.partition("=")
            if key not in ("rank", "step", "microbatch", "stage", "attempt", "ms") or not value.lstrip("-").isdigit():
                raise ConfigError(f"{ENV_VAR}={text!r}: cannot read {field!r}; expected rank=R, step=K, microbatch=I, "
                                  f"stage=S, attempt=A or ms=M")
            values[key] = int(value)
        if "rank" not in values or "step" not in values:
            raise ConfigError(f"{ENV_VAR}={text!r}: needs rank=R and step=K, e.g. stall:rank=1:step=2")
        if kind == "hold" and not os.environ.get(HOLD_VAR):
            raise ConfigError(f"{ENV_VAR}={text!r}: a hold waits while the file {HOLD_VAR} names exists; set "
                              f"{HOLD_VAR}=<path> (and remove that file to release the job)")
        return cls(kind, **values)


class FaultInjector:
    """Wraps the forward of one stage so that it fails as `spec` says; the Trainer sets `step`."""

    def __init__(self, spec: FaultSpec, rank: int) -> None:
        self.spec = spec
        self.rank = rank
        self.step: int | None = None  # the training step now running (None: not training)
        self.fired = False  # a spike fires once

    def install(self, stages: dict[int, Any]) -> None:
        """Hook into the target stage's training forward (this rank's first stage unless `spec.stage`)."""
        target = self.spec.stage if self.spec.stage is not None else min(stages)
        if target in stages:
            stages[target].pre_forward_hooks.append(self._pre_forward)
            stages[target].forward_hooks.append(self._post_forward)

    def _hit(self, i: int) -> bool:
        return self.step == self.spec.step and i == self.spec.microbatch and not (self.spec.kind == "spike" and self.fired)

    def _pre_forward(self, stage: Any, i: int) -> None:
        if self.spec.kind == "slow":
            if self.step is not None and self.step >= self.spec.step:
                if not self.fired:
                    self.fired = True
                    self._announce(stage.index, i)
                time.sleep(self.spec.ms / 1e3)
            return
        if self._hit(i):
            self._before(stage.index, i)

    def _post_forward(self, stage: Any, i: int, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if self.spec.kind == "spike" and self._hit(i):
            return self._spike(stage, i, outputs)
        return self._corrupt(outputs) if self._hit(i) else outputs

    def _spike(self, stage: Any, i: int, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The last stage's micro-batch loss x SPIKE_FACTOR, as reported and as backward starts from it."""
        if not stage.is_last:
            raise ConfigError(f"{ENV_VAR}: a spike multiplies a loss: name the last stage (stage={stage.index} is not)")
        self.fired = True
        scaled = tuple(t * SPIKE_FACTOR for t in outputs)
        stage.losses[i] = stage.losses[i] * SPIKE_FACTOR
        stage._outputs[i] = scaled
        return scaled

    def _announce(self, stage: int, i: int) -> None:
        print(
            f"[pipeflow fault injection] rank {self.rank}: {self.spec.kind} at training step {self.step}, "
            f"stage {stage}, micro-batch {i}, t={time.time():.3f}",
            file=sys.stderr, flush=True,
        )

    def _before(self, stage: int, i: int) -> None:
        self._announce(stage, i)
        kind = self.spec.kind
        if kind == "stall":
            time.sleep(STALL_S)
        elif kind == "hold":
            deadline = time.monotonic() + STALL_S
            while os.path.exists(os.environ[HOLD_VAR]) and time.monotonic() < deadline:
                time.sleep(0.05)
        elif kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "raise":
            raise RuntimeError(f"injected failure in a layer ({ENV_VAR})")
        elif kind == "oom":
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (injected by {ENV_VAR})")

    def _corrupt(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if self.spec.kind == "shape":
            return tuple(t[: max(1, t.shape[0] // 2)] if t.dim() else t for t in outputs)
        if self.spec.kind == "dtype":
            return tuple(t.to(torch.float32 if t.dtype == torch.float64 else torch.float64) for t in outputs)
        if self.spec.kind == "nan":
            return tuple(t * float("nan") if t.is_floating_point() else t for t in outputs)
        if self.spec.kind == "overflow":
            for t in outputs:
                if t.requires_grad:
                    t.register_hook(lambda g: torch.full_like(g, float("inf")))
        return outputs


def install_from_env(stages: dict[int, Any], rank: int, world_size: int | None = None) -> FaultInjector | None:
    """The injector described by ``PIPEFLOW_FAULT_INJECT``, installed on `stages` when it targets
    `rank` (and this launch, ``attempt=A``); None when the variable is unset or names another rank.

    Raises:
        ConfigError: the text cannot be read, or names a rank outside ``0..world_size-1``.
    """
    text = os.environ.get(ENV_VAR)
    if not text:
        return None
    spec = FaultSpec.parse(text)
    if world_size is not None and not 0 <= spec.rank < world_size:
        raise ConfigError(f"{ENV_VAR}={text!r} names rank {spec.rank}, but this job has ranks 0..{world_size - 1}; "
                          f"name one of them (the global rank)")
    if spec.rank != rank or spec.attempt not in (None, int(os.environ.get(ATTEMPT_VAR, "0"))):
        return None
    injector = FaultInjector(spec, rank)
    injector.install(stages)
    return injector
