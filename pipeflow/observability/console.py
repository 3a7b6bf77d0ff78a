"""What reaches the terminal: rank-tagged logging, the progress bar and the per-interval line.

Rank 0 logs INFO and above (through ``tqdm.write`` so the bar is not torn); every other rank
logs only warnings and errors.  Every line carries ``[rank N]``, so a warning from any rank
says where it came from.
"""
from __future__ import annotations

import logging
import sys
from typing import Any

from tqdm import tqdm


class TqdmHandler(logging.StreamHandler):
    """A stream handler that writes around an active tqdm progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        """Write the formatted record above the bar (or plainly when there is none), line and
        newline in one write: ``tqdm.write`` writes them apart, and with unbuffered streams
        (``PYTHONUNBUFFERED=1``, common under Slurm) ranks sharing one terminal or pipe then
        splice each other's lines."""
        try:
            with tqdm.external_write_mode(file=self.stream):
                self.stream.write(self.format(record) + self.terminator)
            self.flush()
        except Exception:  # as logging.StreamHandler: never raise from logging
            self.handleError(record)


class RankFilter(logging.Filter):
    """Adds ``record.rank`` (the process's rank) to every record."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        """Tag the record; never drops one."""
        record.rank = self.rank
        return True


def setup_logging(rank: int) -> None:
    """Rank 0 logs INFO to stdout; other ranks only warnings and errors to stderr; every line is
    tagged ``[rank N]``.  Python ``warnings`` go through logging too (so they are tagged)."""
    handler = TqdmHandler(sys.stdout if rank == 0 else sys.stderr)
    handler.addFilter(RankFilter(rank))
    handler.setFormatter(logging.Formatter("[rank %(rank)d] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logging.captureWarnings(True)


def progress_bar(total: int, enabled: bool, initial: int = 0) -> Any:
    """A tqdm bar over `total` steps on stderr, starting at `initial` (a resumed run); off when
    not `enabled` or stderr is not a terminal."""
    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, leave=False,
                disable=not enabled or not sys.stderr.isatty())


def step_line(
    step: int, max_steps: int, loss: float, grad_norm: float, lr: float, step_s: float,
    samples: int, tokens: int | None, bubble: float, predicted: float, aux: float | None = None,
) -> str:
    """The one line logged per log interval, e.g. ``step 25/300 | loss 2.3412 | grad norm 0.812 |
    lr 3.00e-03 | 41 ms/step | 780 samples/s 49920 tokens/s | bubble 30% (predicted 27%)``; with an
    MoE model's auxiliary loss `aux` (part of the loss) ``| aux 0.0101 |`` follows the loss."""
    rate = f"{samples / step_s:.0f} samples/s" + (f" {tokens / step_s:.0f} tokens/s" if tokens is not None else "")
    aux_part = f" | aux {aux:.4f}" if aux is not None else ""
    return (f"step {step:4d}/{max_steps} | loss {loss:.4f}{aux_part} | grad norm {grad_norm:.3f} | lr {lr:.2e} | "
            f"{1e3 * step_s:.0f} ms/step | {rate} | bubble {bubble:.0%} (predicted {predicted:.0%})")


def summary_line(summary: dict[str, Any]) -> str:
    """The end-of-run line, e.g. ``median step 41 ms | predicted step (calibrated) 40 ms | 780 samples/s |
    bubble 30% measured, 27% predicted | process peak memory (RSS) per pipeline rank 812, 640, 640, 790 MB``
    (``-`` where the run was too short to calibrate): RSS on the CPU, ``(allocator)`` on a GPU
    (``torch.cuda.max_memory_allocated``); tensor bytes have their own line."""
    tokens = summary["tokens_per_s"]
    rate = f"{summary['samples_per_s']:.0f} samples/s" + (f" {tokens:.0f} tokens/s" if tokens is not None else "")
    peaks = ", ".join(f"{mb:.0f}" for mb in summary["peak_memory_mb"])
    kind = "allocator" if any(v == v for v in summary.get("allocator_peak_mb", ())) else "RSS"  # v == v: not NaN
    calibrated = summary.get("step_calibrated_s", float("nan"))
    calibrated_ms = "-" if calibrated != calibrated else f"{1e3 * calibrated:.0f}"
    return (f"median step {1e3 * summary['step_time_s']:.0f} ms | predicted step (calibrated) {calibrated_ms} ms | "
            f"{rate} | bubble {summary['bubble_measured']:.0%} measured, {summary['bubble_predicted']:.0%} predicted | "
            f"process peak memory ({kind}) per pipeline rank {peaks} MB")
