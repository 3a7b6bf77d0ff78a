"""Measuring layers one at a time: parameters, forward/backward time and activation memory.

Only one layer exists at a time (principle 4): each is built, measured and freed before the next
is built.  Timings vary between runs and machines, so in a multi-rank job measure on one rank
and broadcast the profiles (or the resulting ranges): ranks that balance on their own timings
may disagree on the partition.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from pipeflow.models.spec import ModelSpec
from pipeflow.planning.costs import layer_timing as timing
from pipeflow.planning.costs.tp_traffic import TensorTraffic
from pipeflow.runtime.parallel import ring_attention
from pipeflow.runtime.compile import CompileOptions, compile_layer, holds_all_parameters
from pipeflow.runtime.precision import to_compute_dtype
from pipeflow.schedules.auto import StageCosts
from pipeflow.schedules.ir import BACKWARD, FORWARD, WEIGHT, Action, PipelineSchedule


@dataclass(frozen=True)
class LayerProfile:
    """What one layer costs for one micro-batch of the sample's size.

    Attributes:
        name: the layer's name.
        params: number of parameters (elements).
        param_bytes: bytes of the parameters in the profiled dtype.
        forward_s: forward time in seconds (the least of the timed runs: a machine shared with
            other work only adds time).
        backward_s: backward time in seconds, likewise (0 when nothing needs a gradient).
        activation_bytes: bytes kept until the backward: tensors autograd saves (not parameters,
            not the layer's inputs, which are the previous layer's outputs) plus the outputs;
            each storage counted once.
        input_grad_s: time of the input-grad half (B) of a split backward (least of the runs); 0 when not
            measured (``profile_layers(..., split_backward=False)``) or when no input needs a grad.
        weight_grad_s: time of the weight-grad half (W), likewise; 0 when not measured or no
            parameters.
        output_bytes: bytes of the layer's output tensors (what goes to the next stage when a
            stage ends here).
        loss_bytes: on the last layer, profiled with a target: what the model's loss keeps for
            backward beyond the layer's outputs and the target (cross-entropy: the
            log-probabilities); None when not measured.
        loss_saves_output: on the last layer, profiled with a target: whether the loss saves the
            layer's outputs themselves for backward (MSE does; cross-entropy keeps its
            log-probabilities instead): a stage that does not split its backward keeps them only
            then.  True when not measured.
        cpu_fraction: CPU time of the process over wall time while the layer ran (0 for a layer
            that waits, about 1 for one thread computing, more for several); how much cores shared
            with other ranks slow it down (`pipeflow.planning.step_model`).
        tp_split: the fraction of the layer's parameters its tensor-parallel plan splits (0 for a
            model without a plan); `pipeflow.planning.costs.tensor` scales compute and memory by it.
        tp_forward_bytes, tp_backward_bytes: what the plan's collectives would carry in the
            forward (row-wise outputs summed, a head's output gathered: counted as half) and in the
            backward (column-wise inputs' gradients summed), as all-reduce payloads in bytes.
        tp_forward_collectives, tp_backward_collectives: how many collectives carry them.
        tp_norm_bytes: with sequence parallelism, the bytes of the parameters of the plan's
            ``norm`` modules, whose gradients (partial on each rank's slice) are summed over tp in W.
        trainable_bytes: bytes of the parameters that train (gradients, optimizer state) where some
            are frozen (a LoRA run); None: all of them.
        ring_forward_bytes, ring_backward_bytes: profiled with ``parallel.cp``, the bytes one cp
            rank sends round the ring in the layer's forward (key/value blocks) and backward
            (key/value blocks and their gradients); ring_forward_passes, ring_backward_passes: in
            how many passes; ring_forward_hidden_s, ring_backward_hidden_s: the compute between
            posting each pass and waiting for it, summed (what the transfers can hide behind;
            `pipeflow.planning.costs.context` prices them on a link).
    """

    name: str
    params: int
    param_bytes: int
    forward_s: float
    backward_s: float
    activation_bytes: int
    input_grad_s: float = 0.0
    weight_grad_s: float = 0.0
    output_bytes: int = 0
    loss_bytes: int | None = None
    cpu_fraction: float = 1.0
    loss_saves_output: bool = True
    tp_split: float = 0.0
    tp_forward_bytes: int = 0
    tp_backward_bytes: int = 0
    tp_forward_collectives: int = 0
    tp_backward_collectives: int = 0
    tp_norm_bytes: int = 0
    trainable_bytes: int | None = None
    ring_forward_bytes: int = 0
    ring_backward_bytes: int = 0
    ring_forward_passes: int = 0
    ring_backward_passes: int = 0
    ring_forward_hidden_s: float = 0.0
    ring_backward_hidden_s: float = 0.0

    @property
    def seconds(self) -> float:
        """Forward plus backward time in seconds."""
        return self.forward_s + self.backward_s


def action_costs(
    ranges: Sequence[range], profiles: Sequence[LayerProfile], schedule: PipelineSchedule,
    action_overhead_s: float = 0.0, split: set[tuple[int, int]] | None = None,
) -> Callable[[Action], float]:
    """Seconds of each of `schedule`'s actions for the simulator, summed over the stage's layers.

    This is the one cost model of the planner, the start-of-run report and the benchmarks.  F
    costs the stage's forward.  Where the schedule splits a backward (its W is scheduled), B
    costs the input-grad half and W the weight-grad half, as profiled with
    ``split_backward=True``, or half the backward each when the halves were not profiled.  A
    full backward costs the profiled backward, one action (the simulator charges a full B as
    cost(B) + cost(W), so that W costs nothing).  `action_overhead_s` is added once to every
    action.  A schedule may mix both (DualPipeV).

    Args:
        ranges: the layers of each stage.
        profiles: one profile per layer (`profile_layers`).
        schedule: the schedule whose actions are costed.
        action_overhead_s: fixed seconds each action costs beyond its layers (runtime overhead).
        split: (stage, micro-batch) of every W the schedule runs, when the caller has it.
    """
    if split is None:
        split = schedule.split_backwards()
    halves_profiled = any(p.input_grad_s > 0 or p.weight_grad_s > 0 for p in profiles)
    extra = action_overhead_s
    forward = [math.fsum(profiles[i].forward_s for i in r) for r in ranges]
    full = [math.fsum(profiles[i].backward_s for i in r) for r in ranges]
    if halves_profiled:
        input_half = [math.fsum(profiles[i].input_grad_s for i in r) for r in ranges]
        weight_half = [math.fsum(profiles[i].weight_grad_s for i in r) for r in ranges]
    else:
        input_half = weight_half = [b / 2 for b in full]

    def cost(action: Action) -> float:
        s = action.stage
        if action.kind == FORWARD:
            return forward[s] + extra
        if action.kind not in (BACKWARD, WEIGHT):
            raise ValueError(f"unknown action kind {action.kind!r}")
        if (s, action.microbatch) not in split:  # a full backward: all in B
            return full[s] + extra if action.kind == BACKWARD else 0.0
        return (input_half[s] if action.kind == BACKWARD else weight_half[s]) + extra

    return cost


def stage_costs(ranges: Sequence[range], profiles: Sequence[LayerProfile]) -> StageCosts:
    """F, B (input grad) and W (weight grad) seconds of one micro-batch on each stage, summed over
    its layers; half the backward each where the halves were not profiled (as ``action_costs``)."""
    halves = any(p.input_grad_s > 0 or p.weight_grad_s > 0 for p in profiles)

    def total(r: range, pick) -> float:
        return math.fsum(pick(profiles[i]) for i in r)

    forward = tuple(total(r, lambda p: p.forward_s) for r in ranges)
    if halves:
        backward = tuple(total(r, lambda p: p.input_grad_s) for r in ranges)
        weight = tuple(total(r, lambda p: p.weight_grad_s) for r in ranges)
    else:
        backward = weight = tuple(total(r, lambda p: p.backward_s / 2) for r in ranges)
    return StageCosts(forward, backward, weight)


def count_layer_params(spec: ModelSpec) -> list[int]:
    """Count each layer's parameters, building one layer at a time (on the meta device).

    A layer whose builder fails on the meta device is built on the CPU instead.  Each layer is
    freed before the next one is built, so the whole model never exists at once.

    Args:
        spec: the model.

    Returns:
        ``counts[i]``, the number of parameter elements of layer i.
    """
    return [_count_params(spec, i) for i in range(len(spec))]


def _count_params(spec: ModelSpec, index: int) -> int:
    """Build layer `index` (meta device, else CPU), count its parameters, let it go."""
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            module = spec.layers[index].build()
    except Exception:  # a builder that needs real data (.item(), explicit devices): use the CPU
        module = spec.build_layers([index])[0]
    return sum(p.numel() for p in module.parameters())


def profile_layers(
    spec: ModelSpec,
    sample_input: Any,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    repeats: int = 3,
    split_backward: bool = False,
    sample_target: Any = None,
    autocast_dtype: torch.dtype | None = None,
    compiled: CompileOptions | None = None,
    context_parallel: int = 1,
) -> list[LayerProfile]:
    """Profile every layer in order, the sample flowing through them, one layer alive at a time.

    Layer i's input is layer i-1's output, detached, floating tensors requiring grad.  Each layer
    runs one untimed forward+backward (warm-up), then `repeats` timed ones; the least times are
    kept (other work on the machine only adds time).  Nothing it made outlives it (no graph is
    kept by a cycle, see `layer_timing.counting_saved`), and on CUDA the allocator's cache is emptied after.

    Args:
        spec: the model.
        sample_input: the first layer's input for one micro-batch (a Tensor or a tuple); floating
            tensors are cast to `dtype`.
        device: where to build and run the layers (default CPU).
        dtype: floating dtype of layers and activations (default float32).
        repeats: timed runs per layer (>= 1).
        split_backward: also time the backward split as the zero-bubble schedules run it: the
            input-grad half (B) then the weight-grad half (W), into ``input_grad_s`` and
            ``weight_grad_s`` (costs `repeats` more forwards per layer).
        sample_target: the micro-batch's targets: the last layer's ``loss_bytes`` is then what
            ``spec.loss_fn`` keeps for backward on its outputs.
        autocast_dtype: the run's compute dtype (``train.precision``): forwards run under
            ``torch.autocast`` in it, as a stage runs them, and floating outputs are counted and
            passed on in it, as a stage sends them (None: fp32, no autocast).
        compiled: ``train.compile``'s options: each layer compiled as a stage compiles it (its
            warm-up run compiles it), so the profile times the compiled layer; None: eager.
        context_parallel: ``parallel.cp``: the sample is a cp rank's share of the rows, and a
            layer that takes context parallelism attends round a loopback ring of that size
            (:class:`~pipeflow.runtime.parallel.ring_attention.LoopbackRing`): a cp rank's compute and
            saved tensors, its exchanges not counted.

    Returns:
        One `LayerProfile` per layer, in order.

    Raises:
        ValueError: repeats < 1.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    device = torch.device("cpu" if device is None else device)
    inputs = timing.to_device(sample_input, device, dtype, requires_grad=False)
    profiles = []
    for index in range(len(spec)):
        profile, inputs = _profile_one(spec, index, inputs, device, dtype, repeats, split_backward, autocast_dtype,
                                       compiled, context_parallel)
        profiles.append(profile)
    if sample_target is not None and profiles and spec.loss_fn is not None:
        target = sample_target.to(device) if isinstance(sample_target, Tensor) else sample_target
        loss_bytes, saves_output = timing.loss_bytes(spec.loss_fn, inputs, target)
        profiles[-1] = replace(profiles[-1], loss_bytes=loss_bytes, loss_saves_output=saves_output)
    del inputs
    release_cached_memory(device)
    return profiles


def _ring_fields(passes: list[ring_attention.RingPass]) -> dict[str, Any]:
    """The ``ring_*`` fields of a layer's profile from the passes of one forward and backward."""
    fields: dict[str, Any] = {}
    for direction, backward in (("forward", False), ("backward", True)):
        mine = [p for p in passes if p.backward == backward]
        fields[f"ring_{direction}_bytes"] = sum(p.bytes for p in mine)
        fields[f"ring_{direction}_passes"] = len(mine)
        fields[f"ring_{direction}_hidden_s"] = math.fsum(p.hidden_s for p in mine)
    return fields


def release_cached_memory(device: torch.device | str) -> None:
    """Hand the allocator's cached blocks back to the device after a start-of-run measurement.

    What a measurement allocated is free once it returns, but on CUDA the caching allocator
    keeps it reserved, sized and split for the measurement, not the run.  No-op on the CPU.
    """
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _profile_one(
    spec: ModelSpec, index: int, inputs: tuple, device: torch.device,
    dtype: torch.dtype | None, repeats: int, split_backward: bool = False,
    autocast_dtype: torch.dtype | None = None, compiled: CompileOptions | None = None, context_parallel: int = 1,
) -> tuple[LayerProfile, tuple]:
    """Build, measure and free layer `index`; return its profile and the next layer's inputs."""
    module = spec.build_layers([index], device, dtype)[0]
    ring = ring_attention.LoopbackRing(context_parallel)
    if context_parallel > 1:
        ring_attention.attach([module], ring_attention.ContextParallel(ring))
    if compiled is not None:
        unit = spec.unit_to_compile(index, module)
        compile_layer(unit, spec.layers[index].name, compiled, split_backward, holds_all_parameters(unit, module))
    forward = timing.LayerForward(module, device, autocast_dtype)
    params = list(module.parameters())
    traffic = TensorTraffic(spec, index, module)
    timing.time_forward_backward(forward, inputs, device)  # warm-up (and the tp plan's modules' sizes)
    traffic.stop()
    activation_bytes, outputs = timing.activation_bytes(forward, inputs, params)
    outputs = to_compute_dtype(outputs, autocast_dtype)  # what a stage sends on (and the next layer receives)
    times, fractions, passes = [], [], []
    for _ in range(repeats):
        ring.passes.clear()
        wall, cpu = time.perf_counter(), time.process_time()
        times.append(timing.time_forward_backward(forward, inputs, device))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        fractions.append(cpu / wall if wall > 0 and device.type == "cpu" else 0.0)
        passes.append(list(ring.passes))
    halves = ([timing.time_split_backward(forward, inputs, device) for _ in range(repeats)] if split_backward
              else [(0.0, 0.0)])
    for p in params:
        p.grad = None
    fastest = min(range(repeats), key=lambda k: sum(times[k]))
    profile = LayerProfile(
        **_ring_fields(passes[fastest]),
        name=spec.layers[index].name,
        params=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        forward_s=min(t[0] for t in times),
        backward_s=min(t[1] for t in times),
        activation_bytes=activation_bytes,
        input_grad_s=min(h[0] for h in halves),
        weight_grad_s=min(h[1] for h in halves),
        output_bytes=sum(t.numel() * t.element_size() for t in outputs if isinstance(t, Tensor)),
        cpu_fraction=fractions[fastest],
        trainable_bytes=None if all(p.requires_grad for p in params) else sum(p.nbytes for p in params if p.requires_grad),
        **traffic.figures(),
    )
    return profile, timing.to_device(outputs, device, None, requires_grad=True)
