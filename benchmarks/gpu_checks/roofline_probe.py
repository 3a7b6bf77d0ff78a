"""The cluster planner's roofline terms measured on this GPU beside what it predicts for them:
``python benchmarks/gpu_checks/roofline_probe.py`` (the preset from the GPU's name, or
``--preset h100_sxm``).

- matmuls of 49,152 rows at widths 768-8192 in bf16 (``Efficiency.matmul`` and its knee: the
  held-out H100 runs without activation checkpointing read 8% fast at widths 1536-2048);
- an elementwise pass (``a + b``: the other ops' bytes at the memory bandwidth);
- SDPA, causal, forward and backward at 2,048-8,192 keys, head dims 64 and 128 (the fused
  attention term, its FLOPs counted whole; the backward over the forward:
  ``FUSED_ATTENTION_BACKWARD``);
- F.cross_entropy forward and backward on bf16 logits of 32,000 and 131,072 words (the loss's
  bytes, ``CROSS_ENTROPY_BYTES``, at the memory bandwidth).

One markdown row per probe: measured and predicted milliseconds and their ratio (predicted /
measured: above 1, the roofline is slow).  ``--device cpu --quick``: the code path on tiny shapes
(the ratios mean nothing there).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pipeflow.planning.costs.layer_trace import CROSS_ENTROPY_BYTES, LayerShape, Linear  # noqa: E402
from pipeflow.planning.costs.roofline import Efficiency, Placement, layer_profile  # noqa: E402
from pipeflow.planning.hardware import load_hardware  # noqa: E402

PRESETS = (("H200", "h200_sxm"), ("H100", "h100_sxm"), ("A100-SXM4-40GB", "a100_sxm_40gb"), ("A100", "a100_sxm_80gb"),
           ("B200", "b200"))


def preset_of(name: str) -> str | None:
    """The hardware preset of a GPU named `name` (``torch.cuda.get_device_name``), or None."""
    return next((preset for key, preset in PRESETS if key in name), None)


def timed_ms(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median milliseconds of `run` over `repeats` calls after two warm-up calls."""
    for _ in range(2):
        run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            run()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def probes(device: torch.device, quick: bool) -> list[tuple[str, Callable[[], object], LayerShape, str]]:
    """(name, the measured call, the shape the roofline costs, which of its times) per probe."""
    dtype = torch.bfloat16
    rows = 512 if quick else 49_152
    out = []
    for width in ((64, 128) if quick else (768, 1536, 2048, 4096, 8192)):
        a = torch.randn(rows, width, device=device, dtype=dtype)
        w = torch.randn(4 * width, width, device=device, dtype=dtype)
        out.append((f"matmul {rows} x {width} x {4 * width}", lambda a=a, w=w: F.linear(a, w),
                    LayerShape("matmul", linears=[Linear(rows, width, 4 * width)]), "forward"))
    elements = 1 << (16 if quick else 28)
    x, y = (torch.randn(elements, device=device, dtype=dtype) for _ in range(2))
    out.append((f"elementwise a + b, {elements} bf16", lambda: x + y,
                LayerShape("add", residual_bytes=3 * 2 * elements), "forward"))
    for keys in ((128,) if quick else (2048, 8192)):
        for head_dim in (64, 128):
            heads = (256 if quick else 2048) // head_dim
            q, k, v = (torch.randn(1 if quick else 4, heads, keys, head_dim, device=device, dtype=dtype,
                                   requires_grad=True) for _ in range(3))
            flops = 4.0 * q.shape[0] * heads * keys * keys * head_dim
            shape = LayerShape("sdpa", attention_flops=flops, attention_keys=keys)

            def forward(q=q, k=k, v=v) -> torch.Tensor:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            grad = torch.ones_like(forward())

            def backward(q=q, k=k, v=v, grad=grad) -> None:
                torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad)

            out.append((f"sdpa forward, {keys} keys, head dim {head_dim}", forward, shape, "forward"))
            out.append((f"sdpa forward + backward, {keys} keys, head dim {head_dim}", backward, shape, "both"))
    tokens = 64 if quick else 8192
    for vocab in ((512,) if quick else (32_000, 131_072)):
        logits = torch.randn(tokens, vocab, device=device, dtype=dtype, requires_grad=True)
        targets = torch.randint(vocab, (tokens,), device=device)
        forward_bytes, backward_bytes = (x * logits.numel() * logits.element_size() for x in CROSS_ENTROPY_BYTES)
        shape = LayerShape("loss", loss_elements=logits.numel(), loss_bytes=(forward_bytes, backward_bytes))

        def loss(logits=logits, targets=targets) -> None:
            torch.autograd.grad(F.cross_entropy(logits, targets), logits)

        out.append((f"cross-entropy forward + backward, {tokens} x {vocab} bf16", loss, shape, "both"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", help="hardware preset to predict with (default: from the GPU's name)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: the code path only")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, help="also append the table to this markdown file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    preset = args.preset or preset_of(name)
    if preset is None:
        print(f"no preset for {name!r}: pass --preset", file=sys.stderr)
        return 2
    cluster, eff = load_hardware(preset), Efficiency()
    lines = [f"Roofline terms on {name} against the {preset} preset (shipped constants: matmul {eff.matmul}, "
             f"knee {eff.matmul_knee}, attention {eff.attention}); predicted / measured above 1: the roofline is slow",
             "", "| probe | measured ms | predicted ms | predicted / measured |", "| --- | ---: | ---: | ---: |"]
    for label, run, shape, which in probes(device, args.quick):
        cost = layer_profile(shape, 1, Placement(attention="fused"), cluster, eff)
        predicted = 1e3 * (cost.forward_s + (cost.input_grad_s if which == "both" else 0.0))
        measured = timed_ms(run, device, args.repeats)
        lines.append(f"| {label} | {measured:.4g} | {predicted:.4g} | {predicted / measured:.3g} |")
    print("\n".join(lines))
    if args.out:
        with args.out.open("a") as f:
            f.write("\n".join(lines) + "\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
