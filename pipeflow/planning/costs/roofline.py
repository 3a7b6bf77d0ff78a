"""Layers costed without running them: shapes read off a forward on the meta device, timed by a
roofline on a described GPU (`pipeflow.planning.hardware`).

Each layer is built on the meta device (no weights, no memory) and run once on a meta input of one
sample (``seq_len`` tokens) under a torch-function mode that records what it computes: every
``F.linear`` (M x K x N, whether the tp plan splits it column- or row-wise), every
``scaled_dot_product_attention`` (heads x T x T x head size), other matmuls, and the bytes every
other op that makes a new tensor reads and writes.  Autograd's saved tensors give the activation
bytes.  All of it is linear in the micro-batch size b, so one trace serves every b.

A layer's times for one micro-batch of b samples, on one of tp ranks (`layer_profile`):

- F: each linear ``2 M K N / tp`` FLOPs at ``peak x matmul x d / (d + matmul_knee x ridge)`` with d
  the smallest of its dimensions on the rank, ridge the GPU's peak FLOPs per byte of memory
  bandwidth; attention ``4 H T^2 hd / tp`` FLOPs at ``peak x attention`` (unfused attention:
  its two matmuls as above and its scores through memory; a kernel of the previous generation
  at that generation's instruction peak, ``gpu.peak_tflops.<dtype>_legacy``); the other ops'
  bytes at the memory bandwidth (those on the residual stream
  whole on every tp rank, a tp-th with sequence parallelism; the rest a tp-th); the tp plan's
  collectives (a row-wise linear's output summed; with sequence parallelism the same bytes as
  all-gathers and reduce-scatters) as ring collectives on the tp group's link at ``network`` of
  its bandwidth.
- B (input gradients): each linear again, attention twice (a fused kernel 2.5 times: it
  recomputes its scores, five matmuls to the forward's two), twice the other ops' bytes, the
  column-wise linears' input gradients summed over tp; with activation checkpointing, F once
  more (the recomputed forward, its collectives included).
- W (weight gradients): each linear once more.

The five efficiency terms (:class:`Efficiency`) are global constants: matmul and knee fitted
once on the Table 1 runs of Narayanan et al. (SC'21, unfused attention), attention (a fused
kernel's) on the A100 llm-foundry runs with those two held, as
``benchmarks/predictions/published_runs.py`` says; network and overlap (what a collective run
beside compute still costs it) set beforehand from published measurements.  ``--holdout h100
--refit`` fits the three on every published A100 run and judges them on H100 runs they never saw
(``benchmarks/predictions/published/``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from pipeflow.errors import ConfigError
from pipeflow.models.spec import ModelSpec
from pipeflow.planning.costs.expert import RoutedGemm, balanced_hf_experts, layer_experts
from pipeflow.planning.hardware import Cluster, Link
from pipeflow.planning.profile import LayerProfile

SPLIT_STYLES = ("colwise", "colwise_qkv", "colwise_whole", "colwise_out", "rowwise", "embedding")
_MATMULS = {torch.matmul, torch.bmm, torch.baddbmm, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.einsum}


@dataclass(frozen=True)
class Efficiency:
    """The roofline's efficiency terms, five global constants (no per-model or per-row terms).

    Attributes:
        matmul: the fraction of the dense peak a large matmul reaches (fitted).
        matmul_knee: a matmul whose smallest dimension is d runs at ``matmul x d / (d + knee x
            ridge)``, ridge the GPU's FLOPs per byte of memory traffic at its peaks (a narrow
            matmul is bound by memory sooner on a GPU whose compute outgrew its memory; fitted).
        attention: the fraction of the dense peak a fused attention kernel (flash) reaches over
            long sequences, its FLOPs counted whole (the backward's 2.5 times the forward's:
            ``FUSED_ATTENTION_BACKWARD``); a query block streams its T keys, so what it
            loads and stores once (queries, output, the causal diagonal's masked half) is spread
            over T as a matmul's over its smallest dimension: ``attention x T / (T + knee x
            ridge)``, the matmul's knee.  Unfused attention (``Placement.attention``) is two
            batched matmuls at the matmul terms and its T x T scores through memory (fitted).
        network: the fraction of a link's bandwidth its collectives and transfers reach (set
            beforehand: a typical NCCL bus bandwidth over NVSwitch).
        overlap: the fraction of a collective's time that the compute running beside it loses
            (NCCL's kernels hold SMs and move their bytes through the same HBM), so hiding a
            collective of T seconds behind compute still costs ``overlap x T``.  Set beforehand
            from published profiles: 1 - 1/1.76, a GEMM beside an all-gather on A100-SXM4-80GB
            (1.18 -> 2.08 ms, NVIDIA/nccl issue 1428); an H100 GEMM beside FSDP's all-gather
            showed the same scale (80% -> 47% of peak, NVIDIA developer forum thread 337991).

    The other ops (those moving bytes, not FLOPs) run at the GPU's memory bandwidth: a fifth
    fitted term for them settled at 1.0, its bound, in every fit, so it was removed.
    """

    matmul: float = 0.76
    matmul_knee: float = 0.654  # 100 elements on an A100 (ridge 153 FLOPs per byte), as fitted
    attention: float = 0.54  # A100 FlashAttention runs (llm-foundry), matmul and knee held
    network: float = 0.8
    overlap: float = 0.43


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


@dataclass(frozen=True)
class Placement:
    """What the roofline needs of a layout: tp ranks, sequence parallelism, recomputation, the
    compute dtype, the tp group's link and bytes per parameter (weights as computed)."""

    tp: int = 1
    sequence_parallel: bool = False
    recompute: bool = False
    dtype: str = "bf16"
    tp_link: Link | None = None
    # fused: flash kernels of the GPU's own generation; legacy: the previous generation's (FlashAttention
    # 2 on Hopper: the tensor cores through Ampere's instructions, gpu.peak_tflops.<dtype>_legacy);
    # unfused: two batched matmuls and the scores through memory (Megatron 2021)
    attention: str = "fused"
    tp_overlap: bool = False  # the tp collectives run behind the layer's matmuls (Megatron's --tp-comm-overlap)
    ep: int = 1  # expert parallelism: a rank runs 1/ep of the routed experts, each on ep x the rows
    param_bytes: int = 0  # bytes a parameter is kept in (0: weight_bytes(dtype), weights as computed)


# A fused (flash) kernel's backward over its forward, in FLOPs: it recomputes the scores from Q
# and K (QK^T once more), then dV, dP, dQ, dK: five matmuls to the forward's two (Dao, 2023)
FUSED_ATTENTION_BACKWARD = 2.5


def weight_bytes(dtype: str) -> int:
    """Bytes of one parameter in the training dtype `dtype` (fp32 4; bf16, fp16 2; fp8: bf16 weights)."""
    return 4 if dtype == "fp32" else 2


def layer_profile(shape: LayerShape, b: int, place: Placement, cluster: Cluster,
                  eff: Efficiency = Efficiency()) -> LayerProfile:
    """`shape`'s costs for a micro-batch of `b` samples on one of ``place.tp`` ranks, as the
    simulator and the memory model take them (the module docstring's roofline)."""
    tp, sp = place.tp, place.sequence_parallel
    peak = cluster.gpu.peak_flops(place.dtype)
    mem_bps = cluster.gpu.memory_bandwidth_gbps * 1e9

    knee = eff.matmul_knee * peak / mem_bps  # x the ridge, FLOPs per byte

    def at_matmul_rate(flops: float, d: float) -> float:
        return flops / (peak * eff.matmul * d / (d + knee))

    def matmul_s(x: Linear) -> float:
        k, n = (x.k // tp, x.n) if x.style in ("rowwise", "embedding") and tp > 1 else (
            (x.k, x.n // tp) if x.style and tp > 1 else (x.k, x.n))
        rows = b * x.rows
        if x.experts:  # the rank's experts/ep experts, each on the rows ep ranks route to it: d grows
            return x.experts * at_matmul_rate(2.0 * rows * k * n, min(rows * min(place.ep, x.experts), k, n))
        return at_matmul_rate(2.0 * rows * k * n, min(rows, k, n))

    linear_s = sum(matmul_s(x) for x in shape.linears)
    if place.attention == "unfused" and shape.attention_scores:  # QK^T and PV, the scores written and read twice
        attention_s = b * (at_matmul_rate(shape.attention_flops, shape.attention_head_dim)
                           + 4 * 2 * shape.attention_scores / mem_bps + shape.other_matmul_flops / (peak * eff.attention)) / tp
        attention_backward = 2.0  # each of its two matmuls' two gradients
    else:
        kernel_peak = peak
        if place.attention == "legacy" and f"{place.dtype}_legacy" in cluster.gpu.peak_tflops:
            kernel_peak = cluster.gpu.peak_flops(f"{place.dtype}_legacy")
        keys = shape.attention_keys  # a query block's T keys spread its fixed loads and stores
        spread = keys / (keys + eff.matmul_knee * kernel_peak / mem_bps) if keys else 1.0
        rate = kernel_peak * eff.attention * spread
        attention_s = b * (shape.attention_flops + shape.other_matmul_flops) / tp / rate
        attention_backward = FUSED_ATTENTION_BACKWARD
    residual = shape.residual_bytes / (tp if sp else 1)
    bytes_s = b * (residual + shape.split_bytes / tp) / mem_bps
    link = place.tp_link or cluster.intra
    fwd_comm, bwd_comm = _tp_comm(shape, b, tp, link, eff)
    if place.tp_overlap:  # split into chunks that run beside the matmuls: what they cannot cover is exposed
        fwd_comm, bwd_comm = beside(fwd_comm, linear_s, eff), beside(bwd_comm, 2 * linear_s, eff)
    f_scale, b_scale = shape.measured or (1.0, 1.0)  # a measured layer's compute; collectives stay on the links
    forward = f_scale * (linear_s + attention_s + bytes_s) + fwd_comm
    weighted = [x for x in shape.linears if x.style != "embedding"]
    weight_grad = b_scale * sum(matmul_s(x) for x in weighted if x.trainable)
    input_grad = b_scale * (sum(matmul_s(x) for x in weighted) + attention_backward * attention_s + 2 * bytes_s) \
        + bwd_comm
    if shape.linears and all(x.style == "embedding" for x in shape.linears):
        input_grad = b_scale * 2 * bytes_s
    split_scale = 1.0 - shape.tp_split_fraction + shape.tp_split_fraction / tp
    if place.recompute:
        input_grad += forward
        activations = b * shape.input_bytes / (tp if sp else 1)
    else:
        activations = b * (shape.saved_residual_bytes / (tp if sp else 1) + shape.saved_split_bytes / tp)
    params = round(shape.params * split_scale)
    return LayerProfile(
        name=shape.name, params=params, param_bytes=params * (place.param_bytes or weight_bytes(place.dtype)),
        forward_s=forward, backward_s=input_grad + weight_grad, activation_bytes=round(activations),
        input_grad_s=input_grad, weight_grad_s=weight_grad,
        output_bytes=round(b * shape.output_bytes / (tp if sp else 1)),
    )


def beside(comm_s: float, compute_s: float, eff: Efficiency) -> float:
    """Seconds a collective of `comm_s` adds to the `compute_s` it runs beside: what the compute
    cannot cover, or at least the compute's loss while both run (``Efficiency.overlap``)."""
    return max(comm_s - compute_s, eff.overlap * comm_s)


def _tp_comm(shape: LayerShape, b: int, tp: int, link: Link, eff: Efficiency) -> tuple[float, float]:
    """Forward and backward seconds of the tp plan's collectives (ring all-reduce bytes; with
    sequence parallelism an all-gather and a reduce-scatter move the same)."""
    if tp <= 1:
        return 0.0, 0.0
    forward = [x.rows * x.n for x in shape.linears if x.style in ("rowwise", "embedding")]
    forward += [x.rows * x.n / 2 for x in shape.linears if x.style == "colwise_out"]
    forward += [shape.tp_forward_elements] if shape.tp_forward_elements else []
    inputs = {x.input_id: x.rows * x.k for x in shape.linears if x.style.startswith("colwise")}
    bps = link.bandwidth_gbps * 1e9 * eff.network
    width = 2  # bytes per element of the compute dtype's activations (bf16/fp16)

    def ring_s(elements: list[float]) -> float:
        return sum(2 * (tp - 1) / tp * b * e * width / bps + link.latency_us * 1e-6 for e in elements)

    return ring_s(forward), ring_s(list(inputs.values()))


def profiles_at(shapes: Sequence[LayerShape], b: int, place: Placement, cluster: Cluster,
                eff: Efficiency = Efficiency()) -> list[LayerProfile]:
    """Every layer's :func:`layer_profile` at micro-batch size `b`."""
    return [layer_profile(s, b, place, cluster, eff) for s in shapes]


def model_flops_per_token(shapes: Sequence[LayerShape], seq_len: int) -> float:
    """Model FLOPs per token of a training step (forward and backward, no recomputation)."""
    return math.fsum(s.model_flops() for s in shapes) / seq_len
