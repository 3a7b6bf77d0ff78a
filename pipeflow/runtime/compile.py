"""``train.compile``: every pipeline layer compiled on its own (regional compilation), eager where it cannot be.

Each layer's ``forward`` is wrapped by :class:`CompiledForward`: ``torch.compile`` of the layer's
own forward with ``fullgraph=True``, so the layer's forward and backward are each one compiled
graph and its module hooks (FSDP2's) stay outside.  Layers of the same class share one compiled
graph (the layer's parameters are graph inputs), so a stage of twelve blocks compiles once.  A
layer Dynamo cannot capture whole (a graph break, an unsupported op) or the backend cannot
compile runs eager from then on, with a :class:`~pipeflow.errors.CompileFallbackWarning` that
names it and says why: never silently.

Stages whose program splits the backward (a W action) use the split backend of
:mod:`pipeflow.runtime.compiled_backward`, whose compiled backward computes the input gradients
at B and the weight gradients at W, each once; the other stages use torch's own backend.
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeflow.errors import CompileFallbackWarning, ConfigError
from pipeflow.runtime import compiled_backward
from pipeflow.runtime.failures import first_line

log = logging.getLogger("pipeflow")

COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
COMPILE_BACKENDS = ("inductor", "aot_eager")
REFUSED_MODES = {
    "reduce-overhead": "CUDA graph trees break when several forwards run before their backwards, which every "
                       "pipeline schedule does",
    "max-autotune": "it captures CUDA graphs (as reduce-overhead), which break when several forwards run before "
                    "their backwards, as in every pipeline schedule; use max-autotune-no-cudagraphs",
}


@dataclass(frozen=True)
class CompileOptions:
    """How layers are compiled.

    Attributes:
        mode: ``train.compile_mode`` (one of :data:`COMPILE_MODES`).
        backend: ``train.compile_backend``: ``inductor`` (kernels) or ``aot_eager`` (the same
            graphs run as FX, no code generation: quick to compile, for tests and debugging).
        dynamic_dims: dimensions of every input tensor marked dynamic before the first call
            (``(1,)``, the sequence, when micro-batches vary in length), so new lengths reuse
            the compiled graph instead of compiling again.
        no_split: why this run's split-backward stages must stay eager (None: they compile).
    """

    mode: str = "default"
    backend: str = "inductor"
    dynamic_dims: tuple[int, ...] = ()
    no_split: str | None = None  # why the stages that split their backward must run eager in this run


def check_options(mode: str, backend: str) -> None:
    """Raise ConfigError for a ``train.compile_mode`` / ``train.compile_backend`` pipeflow refuses."""
    if mode in REFUSED_MODES:
        raise ConfigError(f"train.compile_mode={mode} is refused: {REFUSED_MODES[mode]}; valid: "
                          f"{', '.join(COMPILE_MODES)}")
    if mode not in COMPILE_MODES:
        raise ConfigError(f"train.compile_mode={mode!r} is not a compile mode; valid: {', '.join(COMPILE_MODES)}")
    if backend not in COMPILE_BACKENDS:
        raise ConfigError(f"train.compile_backend={backend!r} is not supported; valid: {', '.join(COMPILE_BACKENDS)}")


class CompiledForward:
    """A layer's forward compiled whole, falling back to eager (with a warning) when it cannot be.

    Args:
        layer: the layer; its bound ``forward`` is what gets compiled.
        name: the layer's name in the model (what the warning names).
        backend: the torch.compile backend (a name or a callable).
        mode: the compile mode (for a named backend).
        dynamic_dims: input dimensions marked dynamic before each call.
        whole_layer: the compiled module holds every parameter of its pipeline layer, so a W of
            the layer needs no input gradient of it (not kept from B to W).
    """

    def __init__(self, layer: nn.Module, name: str, backend: str | Callable[..., Any], mode: str = "default",
                 dynamic_dims: tuple[int, ...] = (), whole_layer: bool = True) -> None:
        self.eager = layer.forward
        self.name = name
        self.dynamic_dims = dynamic_dims
        self.whole_layer = whole_layer
        options = {"mode": mode} if isinstance(backend, str) and backend == "inductor" and mode != "default" else {}
        self.compiled = torch.compile(self.eager, backend=backend, fullgraph=True, **options)
        self.fallback: str | None = None  # why this layer runs eager

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fallback is not None:
            return self.eager(*args, **kwargs)
        for t in args:
            if isinstance(t, torch.Tensor):
                for d in self.dynamic_dims:
                    if t.dim() > d:
                        torch._dynamo.maybe_mark_dynamic(t, d)
        try:
            out = self.compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as exc:  # graph breaks, unsupported ops, backend failures
            self.fallback = f"{type(exc).__name__}: {first_line(exc)}"
            warnings.warn(CompileFallbackWarning(
                f"train.compile: layer {self.name!r} runs eager: torch.compile could not compile it whole "
                f"({self.fallback}); fix the graph break or set train.compile=false"), stacklevel=2)
            return self.eager(*args, **kwargs)
        if self.whole_layer:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    try:  # a compiled graph's node takes attributes; an eager op's (force_eager stance) does not
                        setattr(t.grad_fn, compiled_backward.NO_INPUT_GRADS_AT_W, True)
                    except AttributeError:
                        pass
        return out


def compile_layer(layer: nn.Module, name: str, options: CompileOptions, split_backward: bool,
                  whole_layer: bool = True) -> CompiledForward | None:
    """Compile `layer`'s forward in place (see the module docstring); returns its wrapper.

    `whole_layer`: `layer` holds every parameter of its pipeline layer (it is the layer, or a
    submodule beside which the layer has no parameters).

    A layer already compiled keeps its wrapper.  With `split_backward` the split backend is used;
    where this torch cannot split (:func:`~pipeflow.runtime.compiled_backward.split_unavailable`)
    the layer stays eager (None is returned) and the caller has warned once.
    """
    if isinstance(layer.__dict__.get("forward"), CompiledForward):
        return layer.__dict__["forward"]
    backend: str | Callable[..., Any] = options.backend
    if split_backward:
        if compiled_backward.split_unavailable() is not None:
            return None
        backend = compiled_backward.split_backend(options.backend, options.mode)
    wrapper = CompiledForward(layer, name, backend, options.mode, options.dynamic_dims, whole_layer)
    layer.forward = wrapper  # an instance attribute: module hooks (FSDP2's) run around it, eagerly
    return wrapper


def compile_stage_layers(stages: dict, units: dict[int, list[tuple[str, nn.Module]]],
                         options: CompileOptions) -> list[CompiledForward]:
    """Compile this rank's `stages` (``{s: Stage}``): `units` gives each stage's (layer name,
    module to compile) pairs, one per layer in order (``ModelSpec.unit_to_compile``); warns once
    when split stages must stay eager on this torch."""
    reason = options.no_split or compiled_backward.split_unavailable()
    if reason is not None and any(stage.split_backward for stage in stages.values()):
        warnings.warn(CompileFallbackWarning(
            f"train.compile: the stages that split their backward (B and W) run eager: {reason} (the compiled "
            f"backward cannot be split into its B and W halves there)"), stacklevel=2)
    wrappers = []
    for s, stage in stages.items():
        if stage.split_backward and reason is not None:
            continue
        for layer, (name, unit) in zip(stage.module, units[s]):
            wrappers.append(compile_layer(unit, name, options, stage.split_backward, holds_all_parameters(unit, layer)))
    return wrappers


def holds_all_parameters(unit: nn.Module, layer: nn.Module) -> bool:
    """True when `unit` (what is compiled of `layer`) holds every parameter of `layer` (then a W
    of the layer needs no input gradient of the compiled region: ``CompiledForward.whole_layer``)."""
    return sum(p.numel() for p in unit.parameters()) == sum(p.numel() for p in layer.parameters())


def forget_compiled() -> None:
    """Drop what Dynamo compiled in this process so far (its caches and counters), so a run
    compiles its own layers afresh.  A process that builds several runs (a sweep's jobs, a resume
    in the same process) would otherwise add each run's layers to the same code objects' caches
    until Dynamo's recompile limit, which under ``fullgraph=True`` is a hard error."""
    torch._dynamo.reset()


def graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process so far (recompiles are the growth of it)."""
    counters = getattr(getattr(torch._dynamo, "utils", None), "counters", None)
    return int(counters["stats"]["unique_graphs"]) if counters is not None else 0


def fallbacks(wrappers: Iterable[CompiledForward]) -> dict[str, str]:
    """Layer name -> why it runs eager, for the layers that fell back."""
    return {w.name: w.fallback for w in wrappers if w.fallback is not None}
