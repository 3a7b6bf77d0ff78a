"""Split any module's forward at named submodule boundaries by tracing it with torch.fx.

`trace_split(root, split_points)` traces ``root.forward`` (on the meta skeleton: no values are
computed), assigns every graph node to a part (a part starts at the first node that runs inside
the module named by a split point) and turns each part into a graph of its own. Values that cross
a boundary, skip connections included, are threaded through the parts in between: part k takes
every value made before it and used at k or later, and returns those used after it, as a tuple
(`run_layers`' convention). Each part becomes a ``torch.fx.GraphModule`` holding the model's own
submodules and parameters under their own paths (state dict keys unchanged).
"""
from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, Sequence

import torch.fx as fx
from torch import Tensor, nn

from pipeflow.errors import ConfigError


class UntraceableModelError(ConfigError):
    """A forward that torch.fx cannot trace (data-dependent control flow, .item(), ...)."""


class _Tracer(fx.Tracer):
    """fx's tracer that remembers the innermost module a tracing error came from."""

    def __init__(self) -> None:
        super().__init__()
        self.failed_in: str | None = None

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = self.path_of_module(m) or "<the model>"
            raise


def _user_frame(exc: BaseException) -> str:
    """file:line of the last traceback frame outside torch (where the untraceable code is)."""
    tb, where = exc.__traceback__, ""
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if "/torch/" not in name and not name.endswith("traced.py"):
            where = f"{name}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


def trace(root: nn.Module) -> fx.Graph:
    """Trace `root.forward` with torch.fx; arguments with defaults are fixed at their defaults.

    Raises:
        UntraceableModelError: naming the construct, the module and the line, and the other forms.
    """
    tracer = _Tracer()
    params = inspect.signature(root.forward).parameters.values()
    concrete = {p.name: p.default for p in params if p.default is not p.empty}
    try:
        return tracer.trace(root, concrete_args=concrete or None)
    except Exception as exc:
        where = tracer.failed_in or "<the model>"
        line = _user_frame(exc)
        raise UntraceableModelError(
            f"cannot split {type(root).__name__} by tracing (split_points): torch.fx failed in module {where!r}"
            f"{' at ' + line if line else ''}: {type(exc).__name__}: {exc}. Control flow on tensor values, "
            f".item(), or other data-dependent Python cannot be traced. Use the blocks form instead: "
            f"from_module(model, before=[...], blocks='<path of the ModuleList>', after=[...], before_fn=..., "
            f"after_fn=...) (model.before / model.blocks / model.after), or pass an nn.Sequential"
        ) from exc


def crossing(value: Any, name: str, point: str) -> Any:
    """`value`, checked to be a tensor: only tensors travel between pipeline stages.

    Raises:
        ConfigError: naming the value, where it crosses and what to do.
    """
    if not isinstance(value, Tensor):
        raise ConfigError(
            f"the traced value {name!r} (a {type(value).__name__}, not a tensor) is made before split point "
            f"{point!r} and used after it: only tensors travel between stages. Compute it after the split point "
            f"(e.g. take x.size(1) inside the later module), move the split point, or use the blocks form")
    return value



def _scopes(node: fx.Node) -> list[str]:
    """The module paths a node runs inside (its module stack, and its own target for modules/attrs)."""
    paths = [path for path, _ in node.meta.get("nn_module_stack", {}).values()]
    if node.op in ("call_module", "get_attr"):
        paths.append(str(node.target))
    return paths


def _inside(node: fx.Node, path: str) -> bool:
    return any(s == path or s.startswith(path + ".") for s in _scopes(node))


@dataclass
class TracedPart:
    """One part of a traced forward: its graph and the model paths (modules, attributes) it uses."""

    name: str
    graph: fx.Graph
    paths: list[str]


def _starts(nodes: list[fx.Node], split_points: Sequence[str]) -> list[int]:
    """The index of the first node inside each split point, checked to increase."""
    starts: list[int] = []
    for point in split_points:
        first = next((i for i, n in enumerate(nodes) if _inside(n, point)), None)
        if first is None:
            raise ConfigError(f"split point {point!r} is not called in the traced forward; name a submodule "
                              f"that forward runs (model.split_points)")
        if starts and first <= starts[-1]:
            raise ConfigError(f"split point {point!r} runs before the split point listed ahead of it; list "
                              f"split_points in forward order: {list(split_points)}")
        starts.append(first)
    return starts


def _part_graph(body: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node] | None, result: Any,
                point: str | None) -> fx.Graph:
    """A graph taking `inputs`, running `body`, returning `outputs` (or `result`, the last part's)."""
    g, env = fx.Graph(), {}
    for v in inputs:
        env[v] = g.placeholder(v.name)
    for n in body:
        env[n] = g.node_copy(n, lambda a: env[a])
    if outputs is None:
        g.output(fx.map_arg(result, lambda a: env[a]))
        return g
    outs, here = [], set(body)
    for v in outputs:
        out = g.call_function(crossing, (env[v], v.name, point))
        outs.append(g.call_method("clone", (out,)) if _kept_here(v, inputs, here) else out)
    g.output(outs[0] if len(outs) == 1 else tuple(outs))
    return g


def _kept_here(value: fx.Node, inputs: list[fx.Node], body: set[fx.Node]) -> bool:
    """Whether `value`, leaving its part, must leave as a copy: the runtime frees a sent output's
    storage once it is sent, so an output must share no tensor with what the stage keeps for backward:
    an input passed through (a skip connection), or a value a node of the part consumed (autograd
    saves an op's input as that very tensor, e.g. a Linear's)."""
    return value in inputs or any(user in body for user in value.users)


def split_graph(graph: fx.Graph, split_points: Sequence[str], names: Sequence[str]) -> list[TracedPart]:
    """Cut `graph` before the first node inside each split point (see the module docstring).

    Args:
        graph: the traced forward.
        split_points: module paths, each the first module of a new part, in forward order.
        names: the parts' names (len(split_points) + 1).

    Raises:
        ConfigError: a split point never runs in the forward, or the points are out of order.
    """
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    bounds = [0, *_starts(nodes, split_points), len(nodes)]
    last = len(bounds) - 2
    part_of = {n: k for k in range(last + 1) for n in nodes[bounds[k]:bounds[k + 1]]}
    part_of.update({n: -1 for n in placeholders})
    part_of[output] = last
    defined = placeholders + nodes
    # live_in[k]: values made before part k and used by part k or later, in order of definition
    live_in = [placeholders] + [
        [v for v in defined if part_of[v] < k and any(part_of[u] >= k for u in v.users)] for k in range(1, last + 1)
    ]
    parts = []
    for k in range(last + 1):
        outputs = None if k == last else live_in[k + 1]
        g = _part_graph(nodes[bounds[k]:bounds[k + 1]], live_in[k], outputs, output.args[0],
                        None if k == last else split_points[k])
        paths = sorted({str(n.target) for n in g.nodes if n.op in ("call_module", "get_attr")})
        parts.append(TracedPart(names[k], g, paths))
    return parts


def build_part(root: nn.Module, part: TracedPart) -> fx.GraphModule:
    """A GraphModule running `part`, holding deep copies of the parts of `root` it uses."""
    module = fx.GraphModule(root, copy.deepcopy(part.graph), class_name=f"Traced_{part.name.replace('.', '_')}")
    return copy.deepcopy(module)
