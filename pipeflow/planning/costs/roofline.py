"""Layers costed without running them: the shapes a meta-device forward records
(`pipeflow.planning.costs.layer_trace`), timed by a roofline on a described GPU
(`pipeflow.planning.hardware`).

A layer's times for one micro-batch of b samples, on one of tp ranks (`layer_profile`):

- F: each linear ``2 M K N / tp`` FLOPs at ``achieved x matmul x d / (d + matmul_knee x ridge)``
  with achieved the fastest a large matmul was measured to run on the GPU (``gpu.matmul_tflops``),
  d the smallest of its dimensions on the rank, ridge the GPU's peak FLOPs per byte of memory
  bandwidth; attention ``4 H T^2 hd / tp`` FLOPs at ``peak x attention`` (unfused attention:
  its two matmuls as above and its scores through memory; a kernel of the previous generation
  at that generation's instruction peak, ``gpu.peak_tflops.<dtype>_legacy``); the other ops'
  bytes at the memory bandwidth (those on the residual stream whole on every tp rank, a tp-th
  with sequence parallelism; the rest a tp-th), and the loss's (``LayerShape.loss_bytes``: whole
  on every tp rank unless vocab-parallel); the tp plan's collectives (a row-wise linear's
  output summed; with sequence parallelism the same bytes as all-gathers and reduce-scatters) as
  ring collectives on the tp group's link at ``network`` of its bandwidth.
- B (input gradients): each linear again, attention twice (a fused kernel 2.5 times: it
  recomputes its scores, five matmuls to the forward's two), twice the other ops' bytes, the
  loss's backward bytes, the column-wise linears' input gradients summed over tp; with
  activation checkpointing, F once more (the recomputed forward, its collectives included).
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
from dataclasses import dataclass
from typing import Sequence

from pipeflow.planning.costs.layer_trace import LayerShape, Linear
from pipeflow.planning.hardware import Cluster, Link
from pipeflow.planning.profile import LayerProfile


@dataclass(frozen=True)
class Efficiency:
    """The roofline's efficiency terms, five global constants (no per-model or per-row terms).

    Attributes:
        matmul: the fraction of the GPU's measured matmul rate (``gpu.matmul_tflops``, the best
            large matmul) a training step's large matmuls reach (fitted).
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

    matmul: float = 0.874  # 0.76 of the A100 peak, fitted on Table 1, over its measured 86.9%
    matmul_knee: float = 0.654  # 100 elements on an A100 (ridge 153 FLOPs per byte), as fitted
    attention: float = 0.55  # A100 FlashAttention runs (llm-foundry), matmul and knee held
    network: float = 0.8
    overlap: float = 0.43



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
    achieved = cluster.gpu.matmul_flops(place.dtype)
    mem_bps = cluster.gpu.memory_bandwidth_gbps * 1e9

    knee = eff.matmul_knee * peak / mem_bps  # x the ridge, FLOPs per byte

    def at_matmul_rate(flops: float, d: float) -> float:
        return flops / (achieved * eff.matmul * d / (d + knee))

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
    loss_tp = tp if shape.loss_split else 1
    loss_forward_s, loss_backward_s = (b * x / loss_tp / mem_bps for x in shape.loss_bytes)
    link = place.tp_link or cluster.intra
    fwd_comm, bwd_comm = _tp_comm(shape, b, tp, link, eff)
    if place.tp_overlap:  # split into chunks that run beside the matmuls: what they cannot cover is exposed
        fwd_comm, bwd_comm = beside(fwd_comm, linear_s, eff), beside(bwd_comm, 2 * linear_s, eff)
    f_scale, b_scale = shape.measured or (1.0, 1.0)  # a measured layer's compute; collectives stay on the links
    forward = f_scale * (linear_s + attention_s + bytes_s + loss_forward_s) + fwd_comm
    weighted = [x for x in shape.linears if x.style != "embedding"]
    weight_grad = b_scale * sum(matmul_s(x) for x in weighted if x.trainable)
    input_grad = b_scale * (sum(matmul_s(x) for x in weighted) + attention_backward * attention_s + 2 * bytes_s
                            + loss_backward_s) + bwd_comm
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
