"""A compiled layer's backward split into its input-gradient (B) and weight-gradient (W) halves.

torch.compile turns a layer's backward into one autograd node that computes every gradient at
once, so a split backward that calls autograd twice (B for the inputs, keeping the graph, then W
for the weights) would run the whole compiled backward twice.  Here the compiled backward graph
(the FX graph AOTAutograd hands its backward compiler) is cut in two before it is compiled:

- the **input half**: every node the inputs' gradients need, returning those gradients and the
  intermediate values the weight half reads (the gradients of the layer's hidden activations);
- the **weight half**: the remaining nodes, from the saved tensors, the output gradients and
  those intermediates to the weights' gradients.

Each half is compiled by the backend's own compiler (inductor's ``compile_fx_inner``, or run as
the FX graph for ``aot_eager``).  At run time the node's backward runs the input half; inside
:func:`deferring_weight_grads` (a stage's B) it leaves the weight half and its inputs on the
autograd node itself and returns no weight gradients; when autograd calls the same node again
(the stage's W walks each layer's graph from its outputs to its parameters) the weight half runs
and the input gradients kept from B are handed back, so any ops around the compiled region are
walked as in eager.  Outside the context (a full backward) both halves run at once.  Every node
of the backward runs exactly once either way.

This is the only module that touches private torch APIs (``torch._dynamo``, ``torch._functorch``,
``torch._inductor``, ``torch._C._current_autograd_node``): :func:`split_unavailable` checks the
version and the names, and a caller falls back to eager layers when it returns a reason.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

log = logging.getLogger("pipeflow")

MIN_TORCH = (2, 6)  # the oldest torch whose AOTAutograd backward-compiler contract this was checked against
PENDING_ATTR = "_pipeflow_weight_half"  # where B leaves the weight half on the autograd node
# set on a node by its layer's forward when the compiled region holds every parameter of the layer:
# W, which walks the layer from its outputs to its parameters, then needs no input gradient from it
NO_INPUT_GRADS_AT_W = "_pipeflow_no_input_grads_at_w"
STATS = {"input_half": 0, "weight_half": 0, "whole": 0}  # backward halves run in this process (tests, benchmarks)
_deferring = False  # a plain global: on CUDA the autograd engine runs backward on its own thread


@contextlib.contextmanager
def deferring_weight_grads() -> Iterator[None]:
    """Within the block, compiled layers' backwards compute input gradients only and keep their
    weight halves on their autograd nodes for the next autograd call of the same node (W)."""
    global _deferring
    before, _deferring = _deferring, True
    try:
        yield
    finally:
        _deferring = before


def _version(text: str) -> tuple[int, int]:
    parts = text.split("+")[0].split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def split_unavailable(version: str | None = None) -> str | None:
    """Why the compiled backward cannot be split with this torch (None: it can)."""
    version = torch.__version__ if version is None else version
    if _version(version) < MIN_TORCH:
        return f"torch {version} is older than {'.'.join(map(str, MIN_TORCH))}"
    try:
        from torch._dynamo.backends import common
        from torch._functorch import config as functorch_config
        from torch._inductor import compile_fx
    except ImportError as exc:
        return f"torch {version} lacks {exc.name or exc}"
    needed = {"torch._C._current_autograd_node": hasattr(torch._C, "_current_autograd_node"),
              "aot_autograd": hasattr(common, "aot_autograd"),
              "compile_fx(inner_compile=)": hasattr(compile_fx, "compile_fx_inner"),
              "functorch config donated_buffer": hasattr(functorch_config, "donated_buffer"),
              "functorch config enable_autograd_cache": hasattr(functorch_config, "enable_autograd_cache")}
    missing = [name for name, present in needed.items() if not present]
    if missing:
        return f"torch {version} lacks {', '.join(missing)}"
    return None


@functools.lru_cache(maxsize=None)
def split_backend(backend: str, mode: str = "default") -> Callable[..., Any]:
    """A torch.compile backend (``inductor`` or ``aot_eager``) whose backward graphs are split.

    One object per (backend, mode): Dynamo reuses a compiled layer for every layer of the same
    code only when they share the backend object.
    """
    from torch._functorch import config as functorch_config

    # Process-wide, as AOTAutograd reads both when a backward runs, not only when it compiles:
    # a cached backward would come back whole, without passing through the split; and a split
    # backward keeps its graph from B to W, so no saved buffer may be donated (freed) in B.
    functorch_config.enable_autograd_cache = False
    functorch_config.donated_buffer = False

    def compile_split(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        weights = _weight_positions(gm, example_inputs)
        if backend == "aot_eager":
            from functorch.compile import make_boxed_func
            from torch._dynamo.backends.common import aot_autograd

            return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward),
                                bw_compiler=lambda g, ex: SplitBackward(g, weights, ex, None))(gm, example_inputs)
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner(g: torch.fx.GraphModule, ex: Sequence[Any], **kwargs: Any) -> Any:
            if not kwargs.get("is_backward"):
                return compile_fx_inner(g, ex, **kwargs)
            kwargs["static_input_idxs"] = []  # the halves' inputs are not the backward's
            return SplitBackward(g, weights, ex, functools.partial(compile_fx_inner, **kwargs))

        return compile_fx(gm, example_inputs, inner_compile=inner,
                          config_patches=list_mode_options(mode) if mode != "default" else None)

    compile_split.__name__ = f"pipeflow_split_{backend}"
    return compile_split


def _weight_positions(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> frozenset[int]:
    """Which of AOTAutograd's primal inputs are parameters: the graph's own (lifted first, with
    its buffers, when Dynamo did not inline the module) and the parameters among the inputs."""
    own = list(gm.named_parameters(remove_duplicate=False))
    offset = len(own) + len(list(gm.named_buffers(remove_duplicate=False)))
    return frozenset(range(len(own))) | frozenset(
        offset + k for k, value in enumerate(example_inputs) if isinstance(value, nn.Parameter))


class SplitBackward:
    """A compiled backward in two halves (module docstring); boxed, as AOTAutograd calls it.

    Args:
        gm: the backward graph (saved tensors and output gradients in, one gradient per primal out).
        weights: the primal positions that are parameters.
        example_inputs: the backward's example inputs (fake tensors).
        compile_half: compiles a half given its graph and example inputs; None: run the FX graph.
    """

    def __init__(self, gm: torch.fx.GraphModule, weights: frozenset[int], example_inputs: Sequence[Any],
                 compile_half: Callable[..., Any] | None) -> None:
        self._boxed_call = True  # on the instance: torch's wrappers copy __dict__, not class attributes
        out = next(n for n in gm.graph.nodes if n.op == "output")
        results = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
        self.count = len(results)
        self.inputs_pos = [k for k, r in enumerate(results) if k not in weights and r is not None]
        self.weights_pos = [k for k, r in enumerate(results) if k in weights and r is not None]
        # what B hands autograd for a deferred weight gradient, and W for an input gradient it does
        # not hand back: a zero of its shape (no memory: an expanded scalar).  autograd drops it (B
        # asks for the inputs' gradients only, W for the weights'), but the wrapper of a
        # tensor-subclass (DTensor: tp-split weights) graph reads every output's size
        # (weights' shapes are static; an input gradient's shape is the one B computed)
        self.placeholders = {k: _zeros_like_meta(results[k].meta.get("val")) for k in self.weights_pos}
        halves = _split(gm, results, self.inputs_pos, self.weights_pos) if self.weights_pos else None
        if halves is None:  # nothing to defer, or nodes neither half needs (side effects): run it whole
            if self.weights_pos:
                log.info("a compiled backward runs whole at B (nodes neither half needs: side effects); "
                         "W hands over its weight gradients")
            self.input_half, self.weight_half = self._compile(gm, example_inputs, compile_half), None
            self.weight_args = []
            return
        input_gm, weight_gm, self.weight_args = halves
        self.input_half = self._compile(input_gm, example_inputs, compile_half)
        weight_examples = [n.meta.get("val") for n in weight_gm.graph.nodes if n.op == "placeholder"]
        self.weight_half = self._compile(weight_gm, weight_examples, compile_half)

    @staticmethod
    def _compile(gm: torch.fx.GraphModule, examples: Sequence[Any],
                 compile_half: Callable[..., Any] | None) -> Callable:
        """A half as a boxed callable (a list of inputs in), compiled by `compile_half` if given."""
        if compile_half is None:
            return lambda args: gm(*args)
        compiled = compile_half(gm, list(examples))
        if getattr(compiled, "_boxed_call", False):
            return compiled
        return lambda args: compiled(*args)

    def __call__(self, args: list[Any]) -> list[Any]:
        node = torch._C._current_autograd_node()
        pending = getattr(node, PENDING_ATTR, None) if node is not None else None
        if pending is not None:  # W: the weight half left by B
            delattr(node, PENDING_ATTR)
            args.clear()
            return pending()
        values = list(args)
        args.clear()
        got = list(self.input_half(list(values)))  # a boxed half may clear the list it is handed
        if self.weight_half is None:  # `got` is every gradient
            STATS["whole"] += 1
            if _deferring and node is not None and self.weights_pos:  # the weights' part handed over at W
                inputs = [(k, got[k]) for k in self.inputs_pos]
                weights = [(k, got[k]) for k in self.weights_pos]
                setattr(node, PENDING_ATTR, functools.partial(self._fill, _at_w(node, inputs) + weights, True))
                return self._fill(inputs, deferred=True)
            return got
        STATS["input_half"] += 1
        split = len(self.inputs_pos)
        inputs_grads, kept = got[:split], got[split:]
        weight_inputs = [values[k] for k in self.weight_args] + kept
        del values, got
        pairs = list(zip(self.inputs_pos, inputs_grads))
        if _deferring and node is not None:
            setattr(node, PENDING_ATTR, functools.partial(self._weights, _at_w(node, pairs), weight_inputs))
            return self._fill(pairs, deferred=True)
        return self._weights(pairs, weight_inputs)

    def _weights(self, pairs: list[tuple[int, Any]], weight_inputs: list[Any]) -> list[Any]:
        STATS["weight_half"] += 1
        assert self.weight_half is not None
        return self._fill(pairs + list(zip(self.weights_pos, self.weight_half(weight_inputs))), deferred=True)

    def _fill(self, pairs: list[tuple[int, Any]], deferred: bool = False) -> list[Any]:
        result: list[Any] = [None] * self.count
        if deferred:  # B: the weights' places hold zeros until W; W: the inputs' it does not hand back
            for k, make in self.placeholders.items():
                result[k] = make() if make is not None else None
        for k, g in pairs:
            result[k] = g
        return result


def _zeros_like_meta(meta: Any) -> Callable[[], torch.Tensor] | None:
    """A maker of zeros shaped like fake tensor `meta` (:func:`_zeros`), or None without one."""
    if not isinstance(meta, torch.Tensor):
        return None
    return functools.partial(_zeros, tuple(int(s) for s in meta.shape), meta.dtype, meta.device)


def _zeros(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros of `shape` that hold no memory: one scalar, expanded."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def _at_w(node: Any, inputs: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """The input gradients W hands back again: zeros of their shapes (expanded scalars: nothing is
    kept from B to W) where the node's layer said W needs none, else those of B (ops of the layer
    around the compiled region, walked by W as in eager, may lead to the layer's other parameters)."""
    if not getattr(node, NO_INPUT_GRADS_AT_W, False):
        return inputs
    return [(k, _zeros(g.shape, g.dtype, g.device) if isinstance(g, torch.Tensor) else None) for k, g in inputs]


def _split(gm: torch.fx.GraphModule, results: list[Any], inputs_pos: list[int], weights_pos: list[int]) -> Any:
    """The input and weight halves of backward graph `gm` (module docstring), or None when some
    node is needed by neither (a side effect the halves would drop).

    Returns:
        (input half, weight half, the backward's input positions the weight half reads); the
        input half returns the input gradients, then the intermediates the weight half reads.
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    input_nodes = _ancestors(results[k] for k in inputs_pos)
    weight_nodes = _ancestors(results[k] for k in weights_pos)
    computed = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    if any(n not in input_nodes and n not in weight_nodes for n in computed):
        return None
    weight_only = [n for n in computed if n in weight_nodes and n not in input_nodes]
    reads: list[torch.fx.Node] = []  # what the weight half takes in: placeholders, then the input half's values
    for n in weight_only:
        for a in n.all_input_nodes:
            if a not in weight_only and a not in reads:
                reads.append(a)
    for k in weights_pos:
        if results[k] not in weight_only and results[k] not in reads:
            reads.append(results[k])
    taken = [n for n in reads if n.op == "placeholder"]
    handed = [n for n in reads if n.op != "placeholder"]

    first = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in graph.nodes:
        if n.op == "placeholder":
            env[n] = first.placeholder(n.name)
            env[n].meta = dict(n.meta)
        elif n in input_nodes:
            env[n] = first.node_copy(n, env.__getitem__)
    first.output(tuple(env[results[k]] for k in inputs_pos) + tuple(env[n] for n in handed))

    second = torch.fx.Graph()
    env = {}
    for n in taken + handed:
        env[n] = second.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in weight_only:
        env[n] = second.node_copy(n, env.__getitem__)
    second.output(tuple(env[results[k]] for k in weights_pos))
    index = {n: k for k, n in enumerate(placeholders)}
    return torch.fx.GraphModule(gm, first), torch.fx.GraphModule(gm, second), [index[n] for n in taken]


def _ancestors(roots: Any) -> set[torch.fx.Node]:
    """Every node the `roots` depend on, themselves included."""
    seen: set[torch.fx.Node] = set()
    stack = [r for r in roots if isinstance(r, torch.fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen
