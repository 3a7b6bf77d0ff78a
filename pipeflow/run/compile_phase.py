"""``train.compile=true``: this rank's layers compiled before the run starts, a phase of the start-up.

torch.compile compiles lazily, at a function's first call; a first training step that compiles
would be minutes long and its time would pass for a step's.  So after the stages are built, each
layer's forward is wrapped (:mod:`pipeflow.runtime.compile`) and the program runs once on the
first batch (as the rehearsal does: nothing of the run changes, gradients dropped, buffers
restored, the random state forked), which compiles every graph a training step uses: forwards,
backwards and, for split-backward stages, both backward halves.  The phase is timed (the slowest
rank's seconds are reported), and graphs Dynamo compiles after it are counted as recompiles at
the end of the run.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from pipeflow.data import microbatch_inputs, microbatch_targets, sequence_lengths
from pipeflow.planning.rehearsal import untouched
from pipeflow.config.schema import tensor_degree
from pipeflow.config.data import typed_data
from pipeflow.run.model_build import built_on_every_rank
from pipeflow.runtime.compile import CompiledForward, CompileOptions, compile_stage_layers, fallbacks, graphs_compiled
from pipeflow.runtime.events import EventRecorder
from pipeflow.runtime.pipeline import Pipeline
from pipeflow.runtime.posting import Posting
from pipeflow.runtime.stage import Stage
from pipeflow.schedules import PipelineSchedule

log = logging.getLogger("pipeflow")


def compile_options(cfg: DictConfig, chunks: int | None = None) -> CompileOptions | None:
    """``train.compile``'s options, or None when the run is eager.  The dimensions in which
    micro-batches differ are marked dynamic, so one graph serves them all: the sequence with
    variable lengths, the rows when the batch does not split into `chunks` (dp x m) equal parts,
    both with ``comm.shapes=per_microbatch``."""
    if not cfg.train.compile:
        return None
    dims = set()
    data = typed_data(cfg.data)
    if sequence_lengths(data) is not None:
        dims.add(1)
    if chunks is not None and data.batch_size % chunks:
        dims.add(0)
    if cfg.comm.shapes == "per_microbatch":
        dims.update((0, 1))
    # The compiled B/W split over tp-split (DTensor) weights gave wrong gradients: with sequence
    # parallelism (ZB-V, pp 2 x tp 2), and without it once a compiled split run of plain weights
    # had run in the same process (a sweep, tests), though right alone.  Until that is understood
    # those stages run eager, named; tp with 1F1B-family schedules compiles.
    tp = tensor_degree(cfg.parallel)
    no_split = (f"parallel.tp={tp}: the compiled B/W split over tensor-parallel weights is not verified "
                f"(wrong gradients in tests)") if tp > 1 else None
    return CompileOptions(mode=cfg.train.compile_mode, backend=cfg.train.compile_backend,
                          dynamic_dims=tuple(sorted(dims)), no_split=no_split)


@dataclass
class CompilePhase:
    """What the compile phase did on this rank.

    Attributes:
        options: how the layers were compiled.
        seconds: the phase's wall time on the slowest rank.
        graphs: graphs Dynamo compiled during the phase on this rank.
        graphs_after: Dynamo's graph count when the phase ended (recompiles are the growth of it).
        layers: the wrapped layers (each knows whether it fell back to eager, and why).
    """

    options: CompileOptions
    seconds: float
    graphs: int
    graphs_after: int
    layers: list[CompiledForward] = field(default_factory=list)

    def recompiles(self) -> int:
        """Graphs compiled on this rank since the phase (new shapes, dtypes or modes)."""
        return graphs_compiled() - self.graphs_after

    def describe(self) -> str:
        """The start-up line."""
        eager = fallbacks(self.layers)
        tail = f"; eager: {', '.join(eager)}" if eager else ""
        return (f"compile: {len(self.layers)} layers on this rank compiled in {self.seconds:.1f} s (slowest rank; "
                f"{self.graphs} graphs here, backend {self.options.backend}, mode {self.options.mode}){tail}")

    def summary(self) -> dict[str, Any]:
        """The run's compile figures: ``seconds``, ``layers`` (compiled on this rank), ``graphs``,
        ``recompiles``, ``eager_layers`` (name -> why)."""
        return {"seconds": self.seconds, "layers": len(self.layers), "graphs": self.graphs,
                "recompiles": self.recompiles(), "eager_layers": fallbacks(self.layers)}


def compile_and_warm_up(
    options: CompileOptions, comm: Any, schedule: PipelineSchedule, stages: dict[int, Stage],
    units: dict[int, list[tuple[str, nn.Module]]],
    first: tuple[Any, Any], m: int, dtype: torch.dtype, shapes: str, lowering: str, sharding: Any = None,
    evaluates: bool = False,
) -> CompilePhase:
    """Compile this rank's layers and run the program once on the `first` batch (module docstring).

    Collective over the world (each pipeline passes its program; one small all-reduce for the time).

    Args:
        options: ``train.compile``'s options.
        comm, schedule, stages: the run's transport, schedule and this rank's stages (their
            ``split_backward`` set here from the program, by the warm-up's Pipeline).
        units: each stage's (layer name, module to compile) pairs (``ModelSpec.unit_to_compile``).
        first: the first batch's (inputs, targets), this replica's share.
        m, dtype: micro-batches per step and the floating dtype of the inputs.
        shapes, lowering: the run's shape mode and posting lowering.
        sharding: the run's FSDP2 sharding (``parallel.shard=full``), which gathers at its shard points.
        evaluates: the run evaluates (``train.eval_batches``): its no-grad graphs are compiled too.
    """
    start, graphs = time.perf_counter(), graphs_compiled()
    # first: the Pipeline sets each stage's split_backward from its program, which the compiling reads
    pipeline = Pipeline(stages, schedule, comm, shapes, Posting(lowering=lowering), EventRecorder(), None, sharding)
    layers = compile_stage_layers(stages, units, options)
    device = comm.device
    inputs = microbatch_inputs(first[0], m, device, dtype) if 0 in stages else None
    targets = microbatch_targets(first[1], m, device) if schedule.num_stages - 1 in stages else None
    def warm_up() -> None:
        with untouched(stages):
            pipeline.run(inputs, targets)
            if evaluates:
                pipeline.eval(inputs, targets)

    built_on_every_rank(warm_up)  # a layer failing to compile on one rank: the same error on every rank
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    after = graphs_compiled()
    return CompilePhase(options, float(seconds), after - graphs, after, layers)
