"""Measuring what the pipeline does: per-rank compute, comm-wait and idle time, the measured
bubble beside the simulator's prediction, peak memory; TensorBoard on rank 0; traces of chosen steps.

Every rank turns the events its ``EventRecorder`` collected during a step into
:class:`~pipeflow.observability.figures.RankFigures` (definitions there); once per log interval
one all-gather brings every rank's sums to rank 0, which writes them to TensorBoard.  The
predicted figures are the layout's one ``Prediction`` (``pipeflow.planning.layout``).

On the CPU every step's actions are recorded (a host clock reading costs nothing).  On CUDA a
recorded step drains the device at its start and end, so only *timed* steps are: the traced and
memory steps and every ``metrics.timed_every``-th step after the warm-up (the per-stage figures
and the calibration come from them); every step's time is the host's, which in steady state
runs one step ahead of the device and so advances at the device's pace.
"""
from __future__ import annotations

import logging
import math
import resource
import statistics
import sys
from dataclasses import astuple, dataclass, fields
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from pipeflow.errors import ConfigError, TrackerError
from pipeflow.observability import console, trace
from pipeflow.observability.calibrated import WARMUP_STEPS, CalibrationLog
from pipeflow.observability.memory import MemoryMetrics, memory_line
from pipeflow.observability.figures import RankFigures, pipeline_bubble, rank_bubble, step_figures, wait_by_link
from pipeflow.observability.routing import RoutingLog, all_to_all_line
from pipeflow.observability.stragglers import StragglerWatch
from pipeflow.observability.trackers import Trackers, chosen_trackers, open_trackers, resolved_params
from pipeflow.runtime.world import hosts
from pipeflow.runtime.events import EventRecorder
from pipeflow.schedules import PipelineSchedule
from pipeflow.runtime.parallel.mesh_order import MeshGrid

if TYPE_CHECKING:
    from pipeflow.planning.layout import Prediction
    from pipeflow.runtime.parallel.routing import RoutingFigures
    from pipeflow.schedules.memory import RankMemory

log = logging.getLogger("pipeflow")


def perplexity(loss: float) -> float:
    """exp(`loss`), the perplexity of a mean cross entropy in nats (inf where exp overflows)."""
    return math.inf if loss > 709 else math.exp(loss)  # NaN stays NaN


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: CUDA max allocated on a GPU, else the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


@dataclass
class StepTiming:
    """One step as the recorder saw it: host start and end (perf_counter s), and its events when
    the step was timed (``timed``) - empty otherwise."""

    start: float
    end: float
    events: list[Any]
    timed: bool


_PACKET = len(fields(RankFigures)) + 3  # pipeline rank, number of steps, figures..., peak memory


def gather_figures(
    totals: RankFigures, steps: int, pp_rank: int, num_pp: int, device: torch.device
) -> tuple[list[RankFigures], list[float]]:
    """All-gather every rank's summed figures (one small collective); returns the per-step mean
    figures and the peak memory of each pipeline rank (data-parallel replicas averaged, peak max)."""
    packet = torch.tensor([pp_rank, steps, *astuple(totals), peak_memory_mb(device)], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(packet) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, packet)
    sums = [RankFigures() for _ in range(num_pp)]
    counts, peaks = [0.0] * num_pp, [0.0] * num_pp
    for row in (g.cpu().tolist() for g in gathered):
        r = int(row[0])
        sums[r] += RankFigures(*row[2:-1])
        counts[r] += row[1]
        peaks[r] = max(peaks[r], row[-1])
    means = [RankFigures(*(v / max(1.0, n) for v in astuple(s))) for s, n in zip(sums, counts)]
    return means, peaks


class RunMetrics:
    """Measures every training step and reports it (TensorBoard, console, trace, fit() summary).

    Collective: every rank creates one and calls :meth:`begin_step`/:meth:`end_step` around each
    step and :meth:`close` at the end.

    Args:
        cfg: the whole config (``metrics``, ``train``, ``data`` groups are read).
        recorder: the recorder this rank's pipeline records into; switched on for each step.
        pp_rank, num_pp: this rank's pipeline rank and the pipeline size p.
        device: this rank's device (collectives and memory).
        run_dir: the run directory every rank agreed on.
        prediction: the layout's prediction (its bubble is shown beside the measured one).
        items: (samples per step, tokens per step or None for non-token data).
        calibrate: recorded steps -> the run's costs (``pipeflow.planning.calibration.calibrate``
            bound to the run's schedule); None: no calibrated prediction.
        first_pipeline: this rank is in the pipeline of global rank 0, whose steps are calibrated.
        grid: every rank's mesh coordinates (``parallel.order``); None: the default order.
    """

    def __init__(
        self, cfg: Any, recorder: EventRecorder, pp_rank: int, num_pp: int, device: torch.device, run_dir: str,
        prediction: Prediction, items: tuple[int, int | None], calibrate: Any = None,
        first_pipeline: bool | None = None, grid: MeshGrid | None = None, watch: StragglerWatch | None = None,
    ) -> None:
        mc = cfg.metrics
        self.log_every = int(cfg.train.log_every)
        if self.log_every < 1:
            raise ConfigError(f"train.log_every={self.log_every} must be at least 1")
        self.max_steps = cfg.train.max_steps
        self.trace_steps = {int(s) for s in mc.trace_steps}
        self.is_main = dist.get_rank() == 0
        if self.is_main and any(s < 0 or s >= self.max_steps for s in self.trace_steps):
            log.warning("metrics.trace_steps=%s: steps outside 0..%d are not traced", sorted(self.trace_steps), self.max_steps - 1)
        self.recorder, self.pp_rank, self.num_pp, self.device = recorder, pp_rank, num_pp, device
        self.run_dir, self.predicted, self.items = run_dir, prediction.bubble, items
        self.full_items = items  # a full batch's
        # train.batch_ramp: step -> (its samples, its tokens, samples and tokens trained by it), see ramp_batches
        self.batch_of: Callable[[int], tuple[int, int | None, int, int | None]] | None = None
        self.interval_items = [0, 0]  # samples and tokens of the interval's steps
        self.predicted_step_s = prediction.step_s
        self.calibration = CalibrationLog(calibrate, pp_rank, num_pp, first_pipeline) if calibrate is not None else None
        self.writer = self._open_trackers(cfg, run_dir)
        self.show_bar, self.bar = self.is_main and mc.progress_bar, None  # the bar opens at the first step
        self.timed_every = mc.timed_every
        self.interval, self.interval_steps = RankFigures(), 0  # the interval's timed steps
        self.interval_times: list[float] = []  # the interval's step times (host)
        self.steady, self.steady_steps = RankFigures(), 0  # every timed step but the first (warm-up)
        self.steady_links: dict[tuple[int, int], float] = {}  # transfer waits per link, summed over those steps
        self.first_pipeline = dist.get_rank() < num_pp if first_pipeline is None else first_pipeline
        self.last_bubble = math.nan
        self.first_step: int | None = None  # 0, or where a resumed run starts
        self.step_times: list[float] = []
        self.traced: dict[int, tuple[float, float, list[tuple[str, str, float, float]]]] = {}
        self.saves: list[tuple[int, str, float, float]] = []  # (step, save | stage | write, start, end)
        self._start = 0.0
        tp = cfg.parallel.tp
        world = dist.get_world_size() if dist.is_initialized() else num_pp * tp
        self.grid = grid if grid is not None else MeshGrid(max(1, world // (num_pp * tp)), num_pp, tp)  # ranks' coordinates
        self.memory = MemoryMetrics(mc.memory_steps, self.max_steps, pp_rank, device, prediction,
                                    self.grid)
        self.routing = RoutingLog()  # an MoE model's router figures (every rank reads the same back)
        self.watch = watch  # metrics.straggler_factor: ranks and links held against their own predictions
        self._transfers: list = []  # the last timed step's transfers (the watch reads them)
        me = dist.get_rank() if dist.is_initialized() else 0
        self.replica = next((k for k, ranks in enumerate(self.grid.pipelines()) if me in ranks), 0)

    def memory_measured(self, step: int, measured: RankMemory, offloaded: float = math.nan) -> None:
        """Gather this measured step's tensor memory from every rank (collective) and write it;
        `offloaded`: this rank's bytes copied to the host in the step (``pipeline.offload``)."""
        self.memory.record(step, measured, self.writer, offloaded)
        if self.writer is not None:
            self.writer.flush()

    def checkpoint_saved(self, step: int, path: str, started: float, staged_s: float,
                         write_s: float | None = None) -> None:
        """A checkpoint of `step` complete at `path`, begun at `started` (``time.perf_counter``):
        rank 0 writes ``checkpoint/stage_s`` (what training waited: the whole save when
        synchronous) and, written in the background, ``checkpoint/write_s`` (off the training
        path), and tags the trackers' runs with it; every rank keeps both spans for the trace
        (``metrics.trace_steps``)."""
        self.saves.append((step, "save" if write_s is None else "stage", started, started + staged_s))
        if write_s is not None:
            self.saves.append((step, "write", started + staged_s, started + staged_s + write_s))
        if self.writer is None:
            return
        self.writer.add_scalar("checkpoint/stage_s", staged_s, step)
        if write_s is not None:
            self.writer.add_scalar("checkpoint/write_s", write_s, step)
        self.writer.checkpoint(step, path)

    def evaluated(self, step: int, loss: float, line: bool = True) -> None:
        """Report a held-out evaluation after `step` steps (rank 0): the log line ``step N |
        held-out loss L | perplexity P`` (where `line`; perplexity for token data) and the
        TensorBoard scalars ``eval/loss`` and ``eval/perplexity``."""
        if not self.is_main:
            return
        tokens = self.items[1] is not None
        if line:
            note = f" | perplexity {perplexity(loss):.4g}" if tokens else ""
            log.info("step %4d | held-out loss %.4f%s", step, loss, note)
        if self.writer is not None:
            self.writer.add_scalar("eval/loss", loss, step)
            if tokens:
                self.writer.add_scalar("eval/perplexity", perplexity(loss), step)
            self.writer.flush()

    def _open_trackers(self, cfg: Any, run_dir: str) -> Trackers | None:
        """Rank 0's trackers (``metrics.trackers``); a tracker that cannot start is a TrackerError on
        every rank (agreed: the others learn it from rank 0) before the first step."""
        names = chosen_trackers(cfg.metrics.trackers, cfg.metrics.tensorboard)
        opened, failure = None, None
        if self.is_main and names:
            try:
                opened = open_trackers(names, run_dir, cfg.metrics.project, resolved_params(cfg), cfg.train.resume)
            except TrackerError as exc:
                failure = str(exc)
        if names != ["tensorboard"] and dist.is_initialized() and dist.get_world_size() > 1:
            told = [failure]
            dist.broadcast_object_list(told, src=0)
            failure = told[0]
        if failure is not None:
            raise TrackerError(failure if self.is_main else f"rank 0: {failure}")
        return opened

    def ramp_batches(self, batch_of: Callable[[int], tuple[int, int | None, int, int | None]]) -> None:
        """``train.batch_ramp``: each step its own size, `batch_of(step)` = (samples, tokens, samples
        and tokens trained by the end of the step; tokens None for non-token data). Throughput is
        the interval's samples over its time; only full-size steps are calibrated and counted in
        the steady figures (the prediction's program)."""
        self.batch_of = batch_of

    def timed(self, step: int) -> bool:
        """Whether step `step` records its actions' events: always on the host clock; on CUDA the
        traced and memory steps and every ``timed_every``-th step after the warm-up."""
        if self.recorder.free or step in self.trace_steps or self.memory.measures(step):
            return True
        first = self.first_step if self.first_step is not None else step
        since = step - first - WARMUP_STEPS
        return since >= 0 and since % self.timed_every == 0

    def begin_step(self, step: int) -> None:
        """Start measuring step `step` (switches the recorder on for a timed step)."""
        if self.first_step is None:
            self.first_step = step
            if self.show_bar:
                self.bar = console.progress_bar(self.max_steps, True, initial=step)
        # a timed step on CUDA: the device drained, a step-start event recorded; else the host's now
        self._start = self.recorder.start(self.timed(step))

    def stop_step(self) -> StepTiming:
        """Stop measuring the step begun last (on a timed CUDA step: the device drained, every
        event read back); its figures are added up by :meth:`end_step` once its loss is known."""
        timed = self.recorder.timed
        events = self.recorder.stop()
        if timed:
            self._transfers = self.recorder.transfers
        return StepTiming(self._start, self.recorder.stopped_at, events, timed)

    def end_step(self, step: int, loss: float, grad_norm: float, lr: float, timing: StepTiming | None = None,
                 routing: RoutingFigures | None = None) -> None:
        """Finish step `step`: add up its figures; at a log step gather them and report.

        Args:
            step, loss, grad_norm, lr: the step and what it read back (loss and norm may come
                back a step late: the Trainer hands them over with the step's `timing`).
            timing: what :meth:`stop_step` returned for this step; None: stop it now.
            routing: an MoE model's router figures of the step (its aux loss on the log line).
        """
        if routing is not None:
            self.routing.record(step, routing, self.writer)
        timing = timing if timing is not None else self.stop_step()
        step_s = timing.end - timing.start
        self.step_times.append(step_s)
        self.interval_times.append(step_s)
        if self.batch_of is not None:
            self.items = self.batch_of(step)[:2]
        self.interval_items[0] += self.items[0]
        self.interval_items[1] += self.items[1] or 0
        if timing.timed:
            self._add_figures(step, timing)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{self.items[0] / step_s:.0f}")
        if step % self.log_every == 0 or step == self.max_steps - 1:
            self._report(step, loss, grad_norm, lr)

    def _add_figures(self, step: int, timing: StepTiming) -> None:
        """A timed step's figures into the interval and steady sums, its record into the calibration and trace."""
        figures = step_figures(timing.events, timing.start, timing.end)
        self.interval += figures
        self.interval_steps += 1
        full = self.items == self.full_items  # a ramp's smaller steps run other programs
        if full and (step > self.first_step or self.max_steps - self.first_step == 1):
            self.steady += figures
            self.steady_steps += 1
            for link, seconds in wait_by_link(timing.events, self.pp_rank).items():
                self.steady_links[link] = self.steady_links.get(link, 0.0) + seconds
        if self.calibration is not None and full and step >= self.first_step + WARMUP_STEPS:
            self.calibration.keep(step, timing.start, timing.end, timing.events)
        if step in self.trace_steps:
            self.traced[step] = (timing.start, timing.end, [(e.kind, e.name, e.start, e.end) for e in timing.events])

    def _report(self, step: int, loss: float, grad_norm: float, lr: float) -> None:
        timed = self.interval_steps > 0  # the same on every rank: every rank times the same steps
        means, peaks = gather_figures(self.interval, self.interval_steps, self.pp_rank, self.num_pp, self.device)
        if self.watch is not None and timed:
            self._watch(step, self.interval.compute_s / self.interval_steps)
        self.interval, self.interval_steps = RankFigures(), 0
        if timed:
            self.last_bubble = pipeline_bubble([f.compute_s for f in means], [f.span_s for f in means])
        bubble = self.last_bubble
        steps = len(self.interval_times)
        step_s = statistics.fmean(self.interval_times) if steps else math.nan
        samples, tokens = self.items
        if self.batch_of is not None and steps:  # the interval's mean batch (its steps' sizes differ)
            samples, tokens = self.interval_items[0] / steps, None if tokens is None else self.interval_items[1] / steps
        self.interval_times, self.interval_items = [], [0, 0]
        if self.is_main:
            aux = self.routing.aux if self.routing.steps else None
            log.info(console.step_line(step, self.max_steps, loss, grad_norm, lr, step_s, samples, tokens, bubble, self.predicted,
                                       aux))
        if self.writer is None:
            return
        scalars = {
            "train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm, "train/step_time_ms": 1e3 * step_s,
            "train/samples_per_s": samples / step_s,
            "pipeline/bubble_measured": bubble, "pipeline/bubble_predicted": self.predicted,
        }
        if tokens is not None:
            scalars["train/tokens_per_s"] = tokens / step_s
        if self.batch_of is not None:  # the batch's size, and what the run has trained (the lr schedule's clock)
            size, _, trained, trained_tokens = self.batch_of(step)
            scalars.update({"train/batch_size": size, "train/samples": trained})
            if trained_tokens is not None:
                scalars["train/tokens"] = trained_tokens
        exchanges = any(f.all_to_all_s > 0 for f in means)  # parallel.ep: the MoE layers' all_to_alls
        for r, (f, peak) in enumerate(zip(means, peaks)):
            scalars[f"stage/{r}/peak_memory_mb"] = peak
            if not timed:
                continue
            scalars.update({
                f"stage/{r}/compute_ms": 1e3 * f.compute_s, f"stage/{r}/comm_wait_ms": 1e3 * f.comm_wait_s,
                f"stage/{r}/idle_ms": 1e3 * f.idle_s, f"stage/{r}/step_ms": 1e3 * f.step_s,
                f"stage/{r}/bubble": rank_bubble(f.compute_s, f.span_s),
            })
            if exchanges:
                scalars[f"stage/{r}/all_to_all_ms"] = 1e3 * f.all_to_all_s
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def _watch(self, step: int, compute_s: float) -> None:
        """Hold this interval's ranks and links against their predictions (collective); rank 0
        names the stragglers (:mod:`pipeflow.observability.stragglers`)."""
        samples = self.watch.sample(dist.get_rank(), self.pp_rank, self.replica, compute_s, self._transfers,
                                    self.device)
        if samples is None:
            return
        lines, scalars = self.watch.judge(step, samples)
        for line in lines:
            log.warning(line)
        if self.writer is not None:
            for tag, value in scalars.items():
                if math.isfinite(value):
                    self.writer.add_scalar(tag, value, step)

    def close(self, schedule: PipelineSchedule) -> dict[str, Any]:
        """Write the traces, close the writer and the bar; returns the run's figures on every rank:
        ``samples_per_s``, ``tokens_per_s`` (None for non-token data), ``step_time_s`` (median),
        ``bubble_measured``, ``bubble_predicted``, ``peak_memory_mb`` (one per pipeline rank: the
        allocator's peak on a GPU, else the process RSS), the tensor memory figures of
        ``pipeflow.observability.memory.MemoryMetrics.summary`` (``tensor_mb``,
        ``tensor_predicted_mb``, ``rss_mb``, ``allocator_peak_mb``, ``memory_step``),
        ``step_predicted_s`` (the start-of-run prediction), ``step_calibrated_s`` (NaN without a
        calibration), ``finish_calibrated_s`` and ``finish_measured_s`` (per pipeline rank)."""
        if self.bar is not None:
            self.bar.close()
        means, peaks = gather_figures(self.steady, self.steady_steps, self.pp_rank, self.num_pp, self.device)
        if self.trace_steps:
            trace.write_traces(self.traced, self.pp_rank, schedule, self.run_dir, self.device, self.predicted, self.writer,
                               self.grid, self.saves)
        step_s = statistics.median(self.step_times) if self.step_times else float("nan")
        samples, tokens = self.full_items
        summary = [{
            "samples_per_s": samples / step_s,
            "tokens_per_s": None if tokens is None else tokens / step_s,
            "step_time_s": step_s,
            "bubble_measured": pipeline_bubble([f.compute_s for f in means], [f.span_s for f in means]),
            "bubble_predicted": self.predicted,
            "peak_memory_mb": peaks,
            **self.memory.summary(self.num_pp),
            "step_predicted_s": self.predicted_step_s,
        }]
        dist.broadcast_object_list(summary, src=0)  # rank 0's step times stand for the run
        summary[0].update(self._calibrated(schedule, summary[0]["step_time_s"]))
        if self.routing.steps:
            summary[0]["moe"] = self.routing.summary()
            summary[0]["moe"]["all_to_all_ms"] = [1e3 * f.all_to_all_s for f in means]  # per pipeline rank, per step
        links = self._link_waits()
        if self.is_main:
            log.info(console.summary_line(summary[0]))
            if links:
                log.info(link_wait_line(links, self.grid))
            for line in self.routing.lines():
                log.info(line)
            if any(f.all_to_all_s > 0 for f in means):
                log.info(all_to_all_line([f.all_to_all_s for f in means], [f.compute_s for f in means]))
            if self.memory.rows:
                log.info("%s\n%s", memory_line(summary[0]), self.memory.table())
        if self.writer is not None:
            self.writer.close()
        return summary[0]

    def _link_waits(self) -> dict[tuple[int, int], float]:
        """Each link's transfer waits per steady step, both its ranks' (the pipeline of global
        rank 0; collective); also to TensorBoard as ``link/<a>-<b>/comm_wait_ms``."""
        mine = {k: v / self.steady_steps for k, v in self.steady_links.items()} if self.steady_steps else {}
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine if self.first_pipeline else {})
        links: dict[tuple[int, int], float] = {}
        for waits in every:
            for link, seconds in waits.items():
                links[link] = links.get(link, 0.0) + seconds
        if self.writer is not None:
            for (a, b), seconds in sorted(links.items()):
                self.writer.add_scalar(f"link/{a}-{b}/comm_wait_ms", 1e3 * seconds, self.max_steps - 1)
        return links

    def _calibrated(self, schedule: PipelineSchedule, step_s: float) -> dict[str, Any]:
        """The calibrated prediction (collective) and its TensorBoard scalars at the last step."""
        if self.calibration is None:
            return {"step_calibrated_s": math.nan, "finish_calibrated_s": [], "finish_measured_s": []}
        figures = self.calibration.finish(schedule, self.run_dir, self.predicted_step_s)
        if self.writer is not None:
            at = self.max_steps - 1
            scalars = {"pipeline/step_measured_ms": step_s, "pipeline/step_predicted_ms": self.predicted_step_s,
                       "pipeline/step_calibrated_ms": figures["step_calibrated_s"]}
            for r, (got, want) in enumerate(zip(figures["finish_measured_s"], figures["finish_calibrated_s"])):
                scalars[f"stage/{r}/program_end_measured_ms"] = got
                scalars[f"stage/{r}/program_end_calibrated_ms"] = want
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, 1e3 * value, at)
        return figures


def link_wait_line(links: dict[tuple[int, int], float], grid: MeshGrid) -> str:
    """``transfer waits per link, ms per step (both ranks): 0-1 1.2; 1-2 8.4 (crosses hosts a -> b);
    2-3 1.1``, and a link waited on at least 3x the median of three or more named."""
    pipeline = grid.pipelines()[0]

    def where(a: int, b: int) -> str:
        ha, hb = hosts.table().host_of(pipeline[a]), hosts.table().host_of(pipeline[b])
        if len(hosts.table().hosts) < 2 or ha is None or hb is None or ha == hb:
            return ""
        return f" (crosses hosts {ha[0]} -> {hb[0]})"

    said = "; ".join(f"{a}-{b} {1e3 * s:.2f}{where(a, b)}" for (a, b), s in sorted(links.items()))
    line = f"transfer waits per link, ms per step (both ranks of each, the pipeline of rank 0): {said}"
    median = statistics.median(links.values())
    if len(links) >= 3 and median > 0:
        slow = [f"{a}-{b}{where(a, b)} {s / median:.1f}x" for (a, b), s in sorted(links.items()) if s >= 3 * median]
        if slow:
            line += f"; waited on far more than the median link: {', '.join(slow)} (a slow link or a slow neighbour)"
    return line

