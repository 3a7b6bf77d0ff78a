"""What one layer computes, read off one forward on the meta device: the shapes the roofline
(`pipeflow.planning.costs.roofline`) times.

Each layer is built on the meta device (no weights, no memory) and run once on a meta input of one
sample (``seq_len`` tokens) under a torch-function mode that records what it computes: every
``F.linear`` (M x K x N, whether the tp plan splits it column- or row-wise), every
``scaled_dot_product_attention`` (heads x T x T x head size), other matmuls, the bytes every
other op that makes a new tensor reads and writes, and the loss's (``F.cross_entropy``: its
log-probabilities too, :data:`CROSS_ENTROPY_BYTES`).  Autograd's saved tensors give the activation
bytes.  All of it is linear in the micro-batch size b, so one trace serves every b.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from pipeflow.errors import ConfigError
from pipeflow.models.spec import ModelSpec
from pipeflow.planning.costs.expert import RoutedGemm, balanced_hf_experts, layer_experts

SPLIT_STYLES = ("colwise", "colwise_qkv", "colwise_whole", "colwise_out", "rowwise", "embedding")
_MATMULS = {torch.matmul, torch.bmm, torch.baddbmm, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.einsum}
# F.cross_entropy's bytes over its logits' (forward, backward): log_softmax reads the logits and
# writes the log-probabilities; the backward writes nll_loss's gradient (zeros, a one per target),
# and log_softmax's backward reads it and the log-probabilities and writes the logits' gradient
CROSS_ENTROPY_BYTES = (2.0, 4.0)


@dataclass(frozen=True)
class Linear:
    """One ``F.linear`` of a layer for one sample: rows M (tokens), K in, N out; `style` its tp
    plan's (``colwise``, ``rowwise``, ... or "" unsplit); `input_id` tells linears sharing an input."""

    rows: float  # a routed expert's: its share of the tokens (balanced routing), not always whole
    k: int
    n: int
    style: str = ""
    input_id: int = 0
    trainable: bool = True  # a frozen weight (LoRA's base) has no weight-gradient matmul
    experts: int = 0  # a routed weight: this many experts' matmuls of `rows` each (0: one dense weight)


@dataclass
class LayerShape:
    """What one layer computes and keeps for ONE sample of ``seq_len`` tokens (`trace_layers`).

    Attributes:
        name: the layer's name.
        params: parameters (elements).
        linears: its linears.
        attention_flops: forward FLOPs of its attention calls (4 H Tq Tk hd each, counted whole).
        other_matmul_flops: forward FLOPs of matmuls between activations.
        residual_bytes, split_bytes: bytes the other ops read and write, on the residual stream
            (width = the layer's hidden size) and elsewhere (split by tp).
        saved_residual_bytes, saved_split_bytes: bytes autograd keeps for the backward, likewise.
        input_bytes, output_bytes: the layer's input (recomputation keeps it) and output (a
            stage boundary sends it).
        tp_split_fraction: the fraction of its parameters the tp plan splits.
        tp_forward_elements: elements the tp plan sums in the forward beyond its linears' (a
            vocabulary-split embedding's output).
        measured: (forward, backward) factors over its compute from a run's profile (`measured_cluster`).
        loss_elements, loss_bytes: the logits its cross-entropy reads (elements) and the bytes
            the loss moves in the forward and the backward (:data:`CROSS_ENTROPY_BYTES`);
            loss_split: whether a tp rank's loss reads its vocabulary share of the logits
            (Megatron's vocab-parallel loss) rather than the whole (pipeflow's gathering head).
        expert_params, top_k, experts: its routed experts' parameters, experts per token and
            experts (0: dense).
    """

    name: str
    params: int = 0
    linears: list[Linear] = field(default_factory=list)
    attention_flops: float = 0.0
    other_matmul_flops: float = 0.0
    residual_bytes: float = 0.0
    split_bytes: float = 0.0
    saved_residual_bytes: float = 0.0
    saved_split_bytes: float = 0.0
    input_bytes: float = 0.0
    output_bytes: float = 0.0
    tp_split_fraction: float = 0.0
    tp_forward_elements: float = 0.0
    measured: tuple[float, float] | None = None
    attention_scores: float = 0.0  # elements of its attention's H x Tq x Tk scores
    attention_head_dim: int = 0
    attention_keys: int = 0  # keys a query of its attention attends (T; the band where windowed)
    expert_params: int = 0  # its routed experts' parameters (expert parallelism splits them)
    top_k: int = 0  # experts per token of its MoE modules (0: dense)
    experts: int = 0  # routed experts of its MoE module (the most ways ep splits them)
    loss_elements: float = 0.0
    loss_bytes: tuple[float, float] = (0.0, 0.0)
    loss_split: bool = False

    def model_flops(self) -> float:
        """Model FLOPs of one sample's forward and backward (6 per parameter-token of its linears, 4
        of a frozen one's, 3 x attention's forward, no recomputation)."""
        linears = sum((6.0 if x.trainable else 4.0) * x.rows * x.k * x.n * max(1, x.experts) for x in self.linears)
        return linears + 3 * (self.attention_flops + self.other_matmul_flops)


def trace_layers(spec: ModelSpec, seq_len: int, dtype: torch.dtype = torch.bfloat16) -> list[LayerShape]:
    """Every layer's :class:`LayerShape` for one sample of `seq_len` tokens, from one forward on the
    meta device (layers of the same type and parameter shapes are traced once)."""
    shapes: list[LayerShape] = []
    inputs: Any = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    seen: dict[tuple, LayerShape] = {}
    last = len(spec.layers) - 1
    built: dict[tuple, tuple[LayerShape, Any]] = {}  # layers described alike (GPT's blocks): traced once
    for index, layer_spec in enumerate(spec.layers):
        alike = _spec_key(layer_spec, inputs, index == last)
        if alike is not None and alike in built:
            shape, inputs = built[alike]
            shapes.append(_renamed(shape, layer_spec.name))
            continue
        layer = _meta_layer(layer_spec, dtype)
        key = (type(layer).__name__, tuple((n, tuple(p.shape)) for n, p in layer.named_parameters()),
               _signature(inputs), index == last)
        if key in seen:
            outputs = _forward_shapes(layer, inputs)
            shapes.append(_renamed(seen[key], layer_spec.name))
        else:
            styles = _linear_styles(spec, index, layer)
            shape, outputs = _trace(layer, layer_spec.name, inputs, styles, spec.loss_fn if index == last else None)
            seen[key] = shape
            shapes.append(shape)
        if alike is not None:
            built[alike] = (shapes[-1], outputs)
        inputs = outputs
    return shapes


def _meta_layer(layer_spec: Any, dtype: torch.dtype) -> nn.Module:
    """The layer built on the meta device in `dtype`.  A model=hf decoder piece built on meta skips
    its rotary module (only a real build adds it): it gets the meta skeleton's, as a real one has it."""
    with torch.device("meta"):
        layer = layer_spec.build()
    owner = getattr(layer_spec.builder, "__self__", None)
    rotary = getattr(getattr(getattr(owner, "root", None), "model", None), "rotary_emb", None)
    if isinstance(rotary, nn.Module) and type(getattr(layer, "adapter", None)).__name__ == "_Decoder" \
            and not hasattr(layer, "rotary_emb"):
        layer.add_module("rotary_emb", rotary)
    return layer.to(device="meta", dtype=dtype)


def _spec_key(layer_spec: Any, inputs: Any, last: bool) -> tuple | None:
    """A key equal for layers built by the same builder from equal arguments (None: unhashable)."""
    key = (layer_spec.builder, layer_spec.args, tuple(sorted(layer_spec.kwargs.items())), _signature(inputs), last)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _renamed(shape: LayerShape, name: str) -> LayerShape:
    copy = LayerShape(**{k: getattr(shape, k) for k in shape.__dataclass_fields__})
    copy.name = name
    return copy


def _signature(inputs: Any) -> tuple:
    items = inputs if isinstance(inputs, tuple) else (inputs,)
    return tuple((tuple(t.shape), t.dtype) if torch.is_tensor(t) else type(t) for t in items)


def _forward_shapes(layer: nn.Module, inputs: Any) -> Any:
    with torch.no_grad():
        return layer(*inputs) if isinstance(inputs, tuple) else layer(inputs)


def _linear_styles(spec: ModelSpec, index: int, layer: nn.Module) -> dict[int, str]:
    """id(weight) -> the tp style of the linear that owns it (from the model's tp plan at tp=1)."""
    plan = spec.tp_plan
    if plan is None:
        return {}
    if callable(plan):
        try:
            styles = plan(index, layer, 1)
        except ConfigError:  # a plan that refuses a layer: costed unsplit
            return {}
    else:
        import fnmatch
        styles = {name: style for pattern, style in plan.items()
                  for name, _ in layer.named_modules() if fnmatch.fnmatch(name, pattern)}
    out: dict[int, str] = {}
    modules = dict(layer.named_modules())
    for name, style in styles.items():
        module = modules.get(name)
        if module is not None and style in SPLIT_STYLES:
            for p in module.parameters(recurse=False):
                out[id(p)] = style
    return out


class _Recorder(TorchFunctionMode):
    """Records linears, attention, matmuls and the bytes of every op that makes a new tensor."""

    def __init__(self, shape: LayerShape, styles: dict[int, str], hidden: int) -> None:
        super().__init__()
        self.shape, self.styles, self.hidden = shape, styles, hidden
        self.in_attention = False
        self.in_rowwise = False  # inside a rowwise linear: what it saves is its input, split over tp

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.in_attention = func is F.scaled_dot_product_attention
        self.in_rowwise = func is F.linear and self.styles.get(
            id(args[1] if len(args) > 1 else kwargs["weight"])) == "rowwise"
        out = func(*args, **kwargs)
        self.in_rowwise = False
        self.in_attention = False
        if func is F.linear:
            x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            rows = x.numel() // x.shape[-1]
            self.shape.linears.append(Linear(rows, w.shape[1], w.shape[0], self.styles.get(id(w), ""), id(x),
                                             w.requires_grad))
        elif func is F.scaled_dot_product_attention:
            q, k, v = args[0], args[1], args[2]
            self.shape.attention_flops += 4.0 * q.numel() * k.shape[-2]
            self.shape.attention_scores += q.numel() // q.shape[-1] * k.shape[-2]
            self.shape.attention_head_dim = int(q.shape[-1])
            self.shape.attention_keys = max(self.shape.attention_keys, int(k.shape[-2]))
            # a fused kernel keeps q, k, v and its output (not the T x T scores the meta math path saves)
            self.shape.saved_split_bytes += _nbytes(q) + _nbytes(k) + _nbytes(v) + _nbytes(out)
        elif func is F.cross_entropy:
            logits = args[0] if args else kwargs["input"]
            self.shape.loss_elements += logits.numel()
            forward, backward = (factor * _nbytes(logits) for factor in CROSS_ENTROPY_BYTES)
            self.shape.loss_bytes = (self.shape.loss_bytes[0] + forward, self.shape.loss_bytes[1] + backward)
        elif func in _MATMULS and torch.is_tensor(out):
            tensors = [a for a in args if torch.is_tensor(a)]
            if len(tensors) >= 2:
                self.shape.other_matmul_flops += 2.0 * out.numel() * tensors[0].shape[-1]
        else:
            if func is F.embedding and self.styles.get(id(args[1])) == "embedding":
                self.shape.tp_forward_elements += out.numel()  # a vocabulary-split lookup summed over tp
            self._elementwise(args, out)
        return out

    def _elementwise(self, args: tuple, out: Any) -> None:
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if torch.is_tensor(t)]
        ins = [a for a in args if torch.is_tensor(a) and not isinstance(a, nn.Parameter)]
        if not outs or not ins or any(t._is_view() for t in outs):
            return
        for t in ins + outs:
            if self._residual(t):
                self.shape.residual_bytes += _nbytes(t)
            else:
                self.shape.split_bytes += _nbytes(t)

    def _residual(self, t: torch.Tensor) -> bool:
        return t.dim() > 0 and t.shape[-1] == self.hidden


def _nbytes(t: torch.Tensor) -> float:
    return float(t.numel() * t.element_size())


def _trace(layer: nn.Module, name: str, inputs: Any, styles: dict[int, str],
           loss_fn: Callable | None) -> tuple[LayerShape, Any]:
    shape = LayerShape(name, params=sum(p.numel() for p in layer.parameters()))
    split = sum(p.numel() for p in layer.parameters() if id(p) in styles)
    shape.tp_split_fraction = split / shape.params if shape.params else 0.0
    items = inputs if isinstance(inputs, tuple) else (inputs,)
    items = tuple(t.detach().requires_grad_() if torch.is_tensor(t) and t.is_floating_point() else t for t in items)
    shape.input_bytes = sum(_nbytes(t) for t in items if torch.is_tensor(t) and t.is_floating_point())
    params = {id(p) for p in layer.parameters()}
    hidden = _hidden(layer, items)
    recorder = _Recorder(shape, styles, hidden)

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if recorder.in_attention:
            return t
        if id(t) not in params and id(base) not in params and id(t) not in packed:
            packed.add(id(t))
            # the residual stream's width, unless a rowwise linear takes it: its input is split
            # over tp (the attention's context before its output projection; Korthikanti et al.)
            if recorder._residual(t) and not recorder.in_rowwise:
                shape.saved_residual_bytes += _nbytes(t)
            else:
                shape.saved_split_bytes += _nbytes(t)
        return t

    packed: set[int] = set()
    shape.expert_params, shape.top_k, shape.experts = layer_experts(layer)

    def routed(gemm: RoutedGemm) -> None:
        shape.linears.append(Linear(gemm.rows, gemm.k, gemm.n, experts=gemm.experts))

    def routed_bytes(rows: float, moved: float, kept: float) -> None:
        shape.split_bytes += rows * moved
        shape.saved_split_bytes += rows * kept

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recorder, \
            balanced_hf_experts(layer, routed, routed_bytes):
        out = layer(*items)
        if loss_fn is not None and torch.is_tensor(out):
            target = torch.zeros(out.shape[:-1], dtype=torch.long, device="meta")
            loss_fn(out, target)
    outs = out if isinstance(out, tuple) else (out,)
    shape.output_bytes = sum(_nbytes(t) for t in outs if torch.is_tensor(t) and t.is_floating_point())
    detached = tuple(t.detach() if torch.is_tensor(t) else t for t in outs)
    return shape, detached if isinstance(out, tuple) else detached[0]


def _hidden(layer: nn.Module, items: tuple) -> int:
    """The residual stream's width: the layer's float input's last dim, else its embedding's."""
    for t in items:
        if torch.is_tensor(t) and t.is_floating_point():
            return int(t.shape[-1])
    for module in layer.modules():
        if isinstance(module, nn.Embedding):
            return module.embedding_dim
    return -1
