"""Experiment trackers beside TensorBoard (``metrics.trackers``): one sink interface the run's
figures feed, so W&B and MLflow hold what TensorBoard holds and nothing is computed twice.

The run's figures (:mod:`pipeflow.observability.metrics`, ``memory``, ``routing``, ``trace``)
are written through a :class:`Trackers` on rank 0, which has a TensorBoard ``SummaryWriter``'s
``add_scalar`` / ``add_image`` / ``flush`` / ``close`` and hands each figure to every sink:

- ``tensorboard``: ``<run_dir>/tb``;
- ``wandb``: a W&B run (``WANDB_MODE=offline`` works with no network; its files under
  ``<run_dir>/wandb``), the run's step as W&B's step metric ``step`` so figures of an earlier step
  (a background save reported later) are kept;
- ``mlflow``: an MLflow run in ``MLFLOW_TRACKING_URI``, else in the run directory's own store
  (``sqlite:///<run_dir>/mlflow.db``, MLflow's default kind of store).

The resolved config is each tracker's run parameters; the run directory and the latest complete
checkpoint are tags. The trackers' run ids are kept in ``<run_dir>/trackers.json``: a resumed run
(``train.resume``) continues the same tracker runs. A tracker that cannot start is a
:class:`~pipeflow.errors.TrackerError` before the first step; one that fails later is a warning and
training goes on without it.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from pipeflow.errors import ConfigError, TrackerError

log = logging.getLogger("pipeflow")

TRACKERS = ("tensorboard", "wandb", "mlflow")
IDS_FILE = "trackers.json"
INSTALL = {"wandb": "pip install 'pipeflow[wandb]'", "mlflow": "pip install 'pipeflow[mlflow]'"}


class Sink(Protocol):
    """One tracker: what a :class:`Trackers` hands it."""

    name: str

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """Scalars of one step."""

    def image(self, tag: str, image: Any, step: int) -> None:
        """An HWC float image (values in 0..1) of one step."""

    def checkpoint(self, step: int, path: str) -> None:
        """A checkpoint of `step` is complete at `path`."""

    def close(self, ok: bool) -> None:
        """The run ended (`ok`: without an error)."""

    def run_id(self) -> str | None:
        """The tracker's run id to continue on a resume (None: nothing to keep)."""

    def where(self) -> str:
        """Where it writes, for the start-of-run line."""


def chosen_trackers(trackers: Iterable[str], tensorboard: bool) -> list[str]:
    """``metrics.trackers`` less ``tensorboard`` where ``metrics.tensorboard=false``, in order, once each.

    Raises:
        ConfigError: an unknown name.
    """
    chosen: list[str] = []
    for name in trackers:
        if name not in TRACKERS:
            raise ConfigError(f"metrics.trackers names {name!r}, which is no tracker; valid: {', '.join(TRACKERS)}")
        if name not in chosen and (tensorboard or name != "tensorboard"):
            chosen.append(name)
    return chosen


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as ``{"train.lr": "0.001", ...}`` (MLflow's parameters are flat strings)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flat_params(value, f"{name}."))
        else:
            flat[name] = json.dumps(value) if isinstance(value, (list, tuple, bool)) or value is None else str(value)
    return flat


def saved_ids(run_dir: str, resume: str | None) -> dict[str, str]:
    """The tracker run ids a resumed run continues: its run directory's ``trackers.json``, else
    (``train.resume=<path>`` in another run directory) the one of the run the path is in."""
    if not resume:
        return {}
    places = [run_dir]
    if resume != "auto":
        path = os.path.abspath(resume)
        places += [path, os.path.dirname(path), os.path.dirname(os.path.dirname(path))]
    for place in places:
        try:
            with open(os.path.join(place, IDS_FILE)) as f:
                return {str(k): str(v) for k, v in json.load(f).items()}
        except (OSError, ValueError):
            continue
    return {}


class TensorBoardSink:
    """``<run_dir>/tb`` through ``torch.utils.tensorboard``."""

    name = "tensorboard"

    def __init__(self, run_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.folder = os.path.join(run_dir, "tb")
        self.writer = SummaryWriter(self.folder)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def image(self, tag: str, image: Any, step: int) -> None:
        self.writer.add_image(tag, image, step, dataformats="HWC")

    def checkpoint(self, step: int, path: str) -> None:
        pass  # its checkpoint/* scalars say it

    def close(self, ok: bool) -> None:
        self.writer.close()

    def run_id(self) -> str | None:
        return None

    def where(self) -> str:
        return f"tensorboard {self.folder}"


class WandbSink:
    """A W&B run: ``project`` (None: ``WANDB_PROJECT``, else ``pipeflow``), named after the run
    directory, continued by id on a resume; ``WANDB_MODE`` and W&B's other variables are its own."""

    name = "wandb"

    def __init__(self, run_dir: str, project: str | None, params: Mapping[str, Any], run_id: str | None) -> None:
        import wandb

        self.wandb = wandb
        settings = wandb.Settings(console="off", x_disable_stats=True, silent=True)
        self.run = wandb.init(project=project or os.environ.get("WANDB_PROJECT") or "pipeflow",
                              name=os.path.basename(os.path.normpath(run_dir)), dir=run_dir, id=run_id,
                              resume="allow" if run_id else None, config=dict(params),
                              tags=None, settings=settings, reinit="create_new")
        self.run.config.update(dict(params), allow_val_change=True)  # a resume may change the layout
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")  # figures of an earlier step (a late save) stay
        self.run.summary["run_dir"] = os.path.abspath(run_dir)
        self.resumed = run_id is not None

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        self.run.log({**values, "step": step})

    def image(self, tag: str, image: Any, step: int) -> None:
        self.run.log({tag: self.wandb.Image(image), "step": step})

    def checkpoint(self, step: int, path: str) -> None:
        self.run.summary.update({"checkpoint/latest": path, "checkpoint/latest_step": step})

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)

    def run_id(self) -> str | None:
        return str(self.run.id)

    def where(self) -> str:
        verb = "continued" if self.resumed else "run"
        return f"wandb {verb} {self.run.id} ({self.run.settings.mode}, project {self.run.project})"


class MlflowSink:
    """An MLflow run in experiment ``project`` (None: ``MLFLOW_EXPERIMENT_NAME``, else
    ``pipeflow``), continued by id on a resume; a run that ends without :meth:`close` (a crash) is
    marked ``FAILED`` at exit."""

    name = "mlflow"
    BATCH = 1000  # MLflow's most metrics per log_batch
    PARAM_BATCH = 100
    PARAM_CHARS = 6000

    def __init__(self, run_dir: str, project: str | None, params: Mapping[str, Any], run_id: str | None) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath(os.path.join(run_dir, 'mlflow.db'))}"
        self.client = MlflowClient(tracking_uri=uri)
        self.uri, self.resumed = uri, run_id is not None
        if run_id is not None:
            self.id = self.client.get_run(run_id).info.run_id
            self.client.update_run(self.id, status="RUNNING")
        else:
            name = project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "pipeflow"
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment is not None else self.client.create_experiment(name)
            self.id = self.client.create_run(experiment_id, run_name=os.path.basename(os.path.normpath(run_dir)),
                                             tags={"pipeflow.run_dir": os.path.abspath(run_dir)}).info.run_id
        logged = self.client.get_run(self.id).data.params
        flat = flat_params(params)
        fresh = [Param(k, v[:self.PARAM_CHARS]) for k, v in flat.items() if k not in logged]
        for i in range(0, len(fresh), self.PARAM_BATCH):
            self.client.log_batch(self.id, params=fresh[i:i + self.PARAM_BATCH])
        changed = {k: v for k, v in flat.items() if k in logged and logged[k] != v[:self.PARAM_CHARS]}
        for key, value in changed.items():  # MLflow's parameters cannot change: a resume's new value is a tag
            self.client.set_tag(self.id, f"resumed.{key}", value[:self.PARAM_CHARS])
        self.open = True
        atexit.register(self._fail_if_open)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(tag, float(value), now, step) for tag, value in values.items()]
        for i in range(0, len(metrics), self.BATCH):
            self.client.log_batch(self.id, metrics=metrics[i:i + self.BATCH])

    def image(self, tag: str, image: Any, step: int) -> None:
        self.client.log_image(self.id, image, key=tag, step=step)

    def checkpoint(self, step: int, path: str) -> None:
        self.client.set_tag(self.id, "pipeflow.checkpoint", path)
        self.client.set_tag(self.id, "pipeflow.checkpoint_step", str(step))

    def close(self, ok: bool) -> None:
        self.open = False
        self.client.set_terminated(self.id, "FINISHED" if ok else "FAILED")

    def _fail_if_open(self) -> None:
        if self.open:
            try:
                self.close(False)
            except Exception:  # noqa: BLE001 - at exit: nothing left to tell
                pass

    def run_id(self) -> str | None:
        return self.id

    def where(self) -> str:
        return f"mlflow {'continued' if self.resumed else 'run'} {self.id} in {self.uri}"


def open_sink(name: str, run_dir: str, project: str | None, params: Mapping[str, Any], ids: Mapping[str, str]) -> Sink:
    """Start tracker `name` for the run in `run_dir`.

    Raises:
        TrackerError: its package is not installed, or it cannot start (no W&B login, an MLflow
            store that does not answer ...): named, with what to do.
    """
    if name == "tensorboard":
        return TensorBoardSink(run_dir)
    kinds: dict[str, Callable[..., Sink]] = {"wandb": WandbSink, "mlflow": MlflowSink}
    try:
        return kinds[name](run_dir, project, params, ids.get(name))
    except ImportError as exc:
        raise TrackerError(f"metrics.trackers names {name}, which is not installed ({exc}): {INSTALL[name]}, or "
                           f"drop it from metrics.trackers") from exc
    except Exception as exc:  # noqa: BLE001 - whatever the tracker raised, named before training starts
        hint = ("set WANDB_MODE=offline to record with no network, or run `wandb login`" if name == "wandb" else
                "set MLFLOW_TRACKING_URI to a store that answers, or unset it for the run directory's own")
        raise TrackerError(f"metrics.trackers: {name} could not start: {type(exc).__name__}: {exc}; {hint}") from exc


class Trackers:
    """Rank 0's trackers behind a TensorBoard ``SummaryWriter``'s calls: scalars are kept per step
    until :meth:`flush`, then each sink gets one call per step; a sink that raises is warned about
    once and dropped (training goes on)."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks
        self.pending: dict[int, dict[str, float]] = {}

    @property
    def names(self) -> list[str]:
        """The sinks still writing."""
        return [sink.name for sink in self.sinks]

    def _each(self, what: str, call: Callable[[Sink], None]) -> None:
        for sink in list(self.sinks):
            try:
                call(sink)
            except Exception as exc:  # noqa: BLE001 - a tracker's failure never stops training
                self.sinks.remove(sink)
                log.warning("metrics.trackers: %s failed (%s: %s: %s); training goes on without it", sink.name,
                            what, type(exc).__name__, exc)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """A scalar of `step`, written at the next :meth:`flush`."""
        self.pending.setdefault(int(step), {})[tag] = float(value)

    def add_image(self, tag: str, image: Any, step: int, dataformats: str = "HWC") -> None:
        """An image of `step` (HWC, floats in 0..1)."""
        if dataformats != "HWC":
            raise ValueError(f"trackers take HWC images, not {dataformats}")
        self._each("an image", lambda sink: sink.image(tag, image, step))

    def flush(self) -> None:
        """Hand every pending step's scalars to each sink."""
        pending, self.pending = self.pending, {}
        for step, values in sorted(pending.items()):
            self._each("scalars", lambda sink: sink.scalars(values, step))

    def checkpoint(self, step: int, path: str) -> None:
        """A complete checkpoint: each tracker's tag or summary names it."""
        self.flush()
        self._each("a checkpoint tag", lambda sink: sink.checkpoint(step, path))

    def close(self, ok: bool = True) -> None:
        """Flush and end every tracker's run."""
        self.flush()
        self._each("closing", lambda sink: sink.close(ok))

    def ids(self) -> dict[str, str]:
        """The sinks' run ids to continue on a resume."""
        return {sink.name: rid for sink in self.sinks if (rid := sink.run_id()) is not None}


def open_trackers(names: list[str], run_dir: str, project: str | None, params: Mapping[str, Any],
                  resume: str | None) -> Trackers:
    """Start every tracker in `names` (rank 0) and keep their run ids in ``<run_dir>/trackers.json``.

    Raises:
        TrackerError: one could not start (the ones started are closed first).
    """
    ids = saved_ids(run_dir, resume)
    sinks: list[Sink] = []
    try:
        for name in names:
            sinks.append(open_sink(name, run_dir, project, params, ids))
    except TrackerError:
        for sink in sinks:
            sink.close(False)
        raise
    trackers = Trackers(sinks)
    log.info("trackers: %s", "; ".join(sink.where() for sink in sinks))
    kept = trackers.ids()
    if kept:
        with open(os.path.join(run_dir, IDS_FILE), "w") as f:
            json.dump(kept, f)
    return trackers


def resolved_params(cfg: Any) -> dict[str, Any]:
    """The run's config as plain containers, interpolations resolved where they resolve (the
    trackers' run parameters)."""
    from omegaconf import DictConfig, OmegaConf

    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)
    try:
        plain = OmegaConf.to_container(node, resolve=True, enum_to_str=True)
    except Exception:  # noqa: BLE001 - an interpolation only Hydra resolves: kept as written
        plain = OmegaConf.to_container(node, resolve=False, enum_to_str=True)
    return plain if isinstance(plain, dict) else {}
