"""The values the builder's phases return (:mod:`pipeflow.run.builder`) and the Trainer holds.

Each is what one phase settled, made once and not reassigned: :class:`RunPlan` (model, data,
schedule, layout), :class:`Topology` (mesh and transport), :class:`ModelParts` (this rank's
stages and what holds their parameters) and :class:`Loop` (what one training step runs over).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from pipeflow.data import Batches
from pipeflow.data.batch_ramp import BatchRamp
from pipeflow.models.spec import ModelSpec
from pipeflow.observability.metrics import RunMetrics
from pipeflow.planning.layout import Layout
from pipeflow.run.compile_phase import CompilePhase
from pipeflow.run.faults import FaultInjector
from pipeflow.run.step_update import StepUpdate
from pipeflow.run.workspace import Workspace
from pipeflow.runtime.compile import CompileOptions
from pipeflow.runtime.events import EventRecorder
from pipeflow.runtime.parallel.fsdp import FullShard
from pipeflow.runtime.memory import MemoryAccountant
from pipeflow.runtime.parallel.mesh import GradReducer, Mesh
from pipeflow.runtime.pipeline import Pipeline
from pipeflow.runtime.posting import Posting
from pipeflow.runtime.stage import Stage
from pipeflow.runtime.tied import TiedWeights
from pipeflow.runtime.transport import Deadlines, P2PComm
from pipeflow.schedules import PipelineSchedule

__all__ = ["Loop", "ModelParts", "RunPlan", "Topology"]


@dataclass(frozen=True)
class RunPlan:
    """The model and data, and the plan every rank makes alike before any group exists.

    Attributes:
        config_hash: the digest of the config every rank agreed on.
        dp, pp, tp, ep: the data-, pipeline-, tensor- and expert-parallel degrees.
        dtype: ``train.param_dtype``.
        spec, schedule: the model's layer specs and the schedule (settled for ``schedule=auto``).
        batches: the train and validation batch sources.
        first: this replica's first batch (the profile's sample, compile's warm-up).
        posting: which lowering the pipeline runs (its auto choice is logged once).
        compile_options: ``train.compile``'s options (None: eager).
        layout: the partition and its prediction (profiled, then with the runtime's measured costs).
        ramp: ``train.batch_ramp`` (None: every step the full batch); ``batches.train`` then
            gives each step its size.
    """

    config_hash: str
    dp: int
    pp: int
    tp: int
    ep: int
    dtype: torch.dtype
    spec: ModelSpec
    schedule: PipelineSchedule
    batches: Batches
    first: tuple
    posting: Posting
    compile_options: CompileOptions | None
    layout: Layout
    ramp: BatchRamp | None = None
    reschedule: Callable[[int], PipelineSchedule] | None = None  # schedule=auto under a ramp: synthesised per count


@dataclass(frozen=True)
class Topology:
    """Where this rank sits: the mesh (in its order), the pipeline's transport, and the deadlines
    every group the run uses keeps (switched to the steady one after the first training step)."""

    mesh: Mesh
    comm: P2PComm
    deadlines: Deadlines


@dataclass(frozen=True)
class ModelParts:
    """This rank's model, built and placed.

    Attributes:
        stages: this rank's stages by index (split over tp, experts over ep, sharded over dp).
        recorder: where the pipeline's actions and the experts' exchanges are timed.
        ep_group: the expert-parallel group (None at ep = 1).
        sharding: ``parallel.shard=full``'s FSDP2 units (None otherwise).
        tied, reducer: tied-weight and data-parallel gradient reduction (reducer None at dp = 1
            or with ``parallel.shard=full``).
        compiled: ``train.compile``'s start-up phase (None: eager), its recompiles reported at the end.
        params: the parameters that train (a LoRA run's frozen base is not among them).
        cp_comm: the cp group's transport, whose ring the attention layers pass round (None at cp = 1).
    """

    stages: dict[int, Stage]
    recorder: EventRecorder
    ep_group: dist.ProcessGroup | None
    sharding: FullShard | None
    tied: TiedWeights
    reducer: GradReducer | None
    compiled: CompilePhase | None
    params: list[torch.nn.Parameter]
    cp_comm: P2PComm | None = None


@dataclass(frozen=True)
class Loop:
    """What a training step runs over, besides the stages.

    Attributes:
        pipeline: the interpreter of this rank's program.
        update: the step's update after the pipeline ran (reductions, clip, optimizer, the fp16
            loss scaler, ``train.check_finite``'s check, the MoE routers' statistics).
        faults: the fault injector (tests, drills), or None.
        metrics: what is measured and logged.
        workspace: the run directory (its lock, released at the end of ``fit``, and job token).
        memory: counts this rank's tensor bytes on the steps ``metrics.memory_steps`` names.
    """

    pipeline: Pipeline
    update: StepUpdate
    faults: FaultInjector | None
    metrics: RunMetrics
    workspace: Workspace
    memory: MemoryAccountant
