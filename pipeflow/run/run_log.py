"""The lines rank 0 logs when a training run starts and ends: its layout, mesh and settings, then its losses."""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from pipeflow.data import sequence_lengths
from pipeflow.observability.metrics import perplexity
from pipeflow.run.compile_phase import CompilePhase
from pipeflow.config.data import typed_data
from pipeflow.runtime.parallel.mesh import Mesh


def start_lines(cfg: DictConfig, mesh: Mesh, described: str, run_dir: str, compiled: CompilePhase | None,
                shapes_mode: str) -> list[str]:
    """What a run says before its first step: the layout (`described`), the run directory, the
    mesh and its order, the compile phase and whether micro-batch shapes vary (`shapes_mode`)."""
    tp = f", sequence parallel={cfg.parallel.sequence_parallel}" if mesh.tp > 1 else ""
    ep = cfg.parallel.ep
    tp += f", experts split over ep={ep} dp ranks (all_to_all)" if ep > 1 else ""
    lines = [described, f"run directory: {run_dir}",
             f"mesh: {mesh.describe()}, shard={cfg.parallel.shard}{tp}, precision={cfg.train.precision}, "
             f"activation checkpointing={cfg.pipeline.checkpoint_activations}",
             f"{mesh.grid.describe()}{mesh.order_reason}"]
    if compiled is not None:
        lines.append(compiled.describe())
    lengths = sequence_lengths(typed_data(cfg.data))
    if lengths is not None or shapes_mode == "per_microbatch":
        drawn = f"; sequence lengths drawn from {lengths[0]}..{lengths[1]}" if lengths is not None else ""
        lines.append(f"micro-batches of a step may differ in shape (each learned per step){drawn}")
    return lines


def compile_line(summary: dict[str, Any], seconds: float) -> str:
    """The compile phase's end: recompiles after it (`summary`, :meth:`CompilePhase.summary`)."""
    recompiles = summary["recompiles"]
    hint = "" if recompiles == 0 else " (new shapes, dtypes or modes: see TORCH_LOGS=recompiles)"
    return f"compile: {recompiles} recompiles on rank 0 after the compile phase ({seconds:.1f} s at start-up){hint}"


def end_line(result: dict[str, Any], best_loss: float | None, with_perplexity: bool) -> str:
    """A finished run's losses (`result`: :meth:`Trainer.fit`'s), beside the best achievable and
    the held-out perplexity when the metrics report one."""
    first_val, final_val = result["first_val_loss"], result["val_loss"]
    best = f" (best achievable {best_loss:.4f})" if best_loss is not None else ""
    ppl = (f" | held-out perplexity {perplexity(first_val):.4g} -> {perplexity(final_val):.4g}"
           if with_perplexity else "")
    return (f"loss {result['first_loss']:.4f} -> {result['last_loss']:.4f} | held-out loss {first_val:.4f} -> "
            f"{final_val:.4f}{best}{ppl}")
