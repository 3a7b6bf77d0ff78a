"""The cases of tests/test_long_run.py's 4-process world (issue 63: what a long pre-training run
expects): the trackers beside TensorBoard on pp 2 x dp 2 across a resume; batch-size ramp-up against the
unsplit model and resumed mid-ramp.

Not collected on its own (no ``test_`` prefix): test_long_run.py runs these in its world.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import re
import struct
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from fault_cases import _Logged, _on_rank0, _shared_dir

STEP_LINE = re.compile(r"step\s+(\d+)/\d+ \| loss ([\d.]+)")


def _listen() -> _Logged:
    """The pipeflow logger's lines from now until :func:`_unlisten` (INFO: the step lines are)."""
    console, logger = _Logged(), logging.getLogger("pipeflow")
    console.level_before = logger.level
    logger.addHandler(console)
    logger.setLevel(logging.INFO)
    return console


def _unlisten(console: _Logged) -> None:
    """Stop collecting into `console` and give the logger back its level."""
    logger = logging.getLogger("pipeflow")
    logger.removeHandler(console)
    logger.setLevel(console.level_before)


def wandb_records(run_dir: str, run_id: str) -> list[dict[str, Any]]:
    """Every history row W&B wrote offline for run `run_id` under `run_dir` (each offline run
    folder of that id, oldest first): read from its ``.wandb`` file (a LevelDB-style log of
    protobuf records: 7-byte header, then records in 32 KiB blocks, each chunk with a 7-byte head)."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for path in sorted(glob.glob(os.path.join(run_dir, "wandb", f"offline-run-*-{run_id}", f"run-{run_id}.wandb"))):
        data = open(path, "rb").read()
        assert data[:4] == b":W&B", path
        pos, block, pending = 7, 32768, b""
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a chunk head is padding
                pos += block - pos % block
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            pending += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a whole record, or a record's last chunk
                record = pb.Record()
                record.ParseFromString(pending)
                pending = b""
                if record.WhichOneof("record_type") == "history":
                    rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def _series(rows: list[dict[str, Any]], tag: str) -> list[tuple[int, float]]:
    return [(int(row["step"]), float(row[tag])) for row in rows if tag in row]


def trackers_across_a_resume() -> dict[str, Any]:
    """pp 2 x dp 2 with metrics.trackers=[tensorboard,wandb,mlflow] (W&B offline, MLflow in the run
    directory): 4 steps saving at 2 and 4, then train.resume=auto to step 6. Every rank: its pp rank
    and the losses it trained; rank 0: the console's step lines, what each tracker holds, the
    trackers' run ids before and after the resume, and a refused tracker's error."""
    import scale_cases
    from pipeflow.errors import TrackerError
    from pipeflow.run.builder import build_run

    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    parent = _shared_dir()
    run_dir = os.path.join(parent, "run")
    console = _listen()
    out: dict[str, Any] = {"losses": {}, "ids": []}
    try:
        for steps in (4, 6):
            cfg = scale_cases.make_config(2, "1f1b", 2, train__run_dir=run_dir, train__max_steps=steps,
                                          train__save_every=2, train__log_every=1, train__resume="auto",
                                          metrics__trackers=["tensorboard", "wandb", "mlflow"])
            trainer = build_run(cfg, torch.device("cpu"))
            try:
                trainer.fit()
            finally:
                trainer.close()
            out["pp_rank"] = trainer.topology.mesh.pp_rank
            out["losses"].update({step: loss for step, loss in zip(range(steps - len(trainer.history), steps),
                                                                   trainer.history)})
            if dist.get_rank() == 0:
                with open(os.path.join(run_dir, "trackers.json")) as f:
                    out["ids"].append(json.load(f))
        os.environ["MLFLOW_TRACKING_URI"] = "nosuchstore://nowhere"
        try:
            build_run(scale_cases.make_config(2, "1f1b", 2, train__run_dir=os.path.join(parent, "refused"),
                                              metrics__trackers=["mlflow"]), torch.device("cpu"))
        except TrackerError as exc:
            out["refused"] = str(exc)
        del os.environ["MLFLOW_TRACKING_URI"]
        if dist.get_rank() == 0:
            out["console"] = [(int(m.group(1)), float(m.group(2))) for line in console.lines
                              if (m := STEP_LINE.search(line))]
            ids = out["ids"][-1]
            out["wandb"] = _series(wandb_records(run_dir, ids["wandb"]), "train/loss")
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=f"sqlite:///{os.path.join(run_dir, 'mlflow.db')}")
            run = client.get_run(ids["mlflow"])
            out["mlflow"] = sorted((m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "train/loss"))
            out["mlflow_runs"] = len(client.search_runs([run.info.experiment_id]))
            out["mlflow_status"] = run.info.status
            out["mlflow_params"] = {k: run.data.params.get(k) for k in ("parallel.dp", "train.save_every")}
            out["mlflow_checkpoint"] = run.data.tags.get("pipeflow.checkpoint")
            out["tensorboard"] = os.path.isdir(os.path.join(run_dir, "tb"))
    finally:
        _unlisten(console)
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        _on_rank0(lambda: __import__("shutil").rmtree(parent, ignore_errors=True))
    return out


RAMP = {"start": 4, "increment": 4, "samples": 24}  # 4 -> 8 -> 12 -> 16 samples from steps 0, 2, 3, 4


def ramp_vs_unsplit() -> dict[str, Any]:
    """dp 2 x pp 2, 1F1B, a global batch ramped 4 -> 8 -> 12 -> 16 (1 -> 4 micro-batches a
    replica) against the unsplit model trained on each step's batch with the same learning rate
    (float64): worst relative differences of loss and parameters per step; each step's micro-batch
    count and lr; whether each step's batch is the one a source of that size gives; then the same
    run saved at step 3 (mid-ramp) and resumed to step 7, and schedule=auto ramped over 5 steps:
    their losses against the straight run's."""
    import scale_cases
    from pipeflow.data import build_batches
    from pipeflow.data.batch_ramp import RampedBatches
    from pipeflow.run.builder import build_run
    from pipeflow.config.data import typed_data
    from pipeflow.run.step_update import lr_at

    steps = 7
    parent = _shared_dir()
    trainers = []
    try:
        cfg = scale_cases.make_config(2, "1f1b", 4, data__batch_size=16, train__max_steps=steps,
                                      train__batch_ramp=RAMP, train__run_dir=os.path.join(parent, "straight"))
        trainer, reference = build_run(cfg, torch.device("cpu")), scale_cases.Reference(cfg)
        trainers.append(trainer)
        ramp = trainer.plan.ramp
        reference.batches.train = RampedBatches(reference.batches.train, ramp)
        both = [(a, b) for a, b in scale_cases.pairs(trainer, reference) if b.requires_grad]
        out: dict[str, Any] = {"loss": 0.0, "param": 0.0, "counts": [], "lr": [], "sized": [], "compared": len(both)}
        losses = []
        for step in range(steps):
            loss, _ = trainer.train_step(step)
            losses.append(loss)
            lr = trainer.loop.update.optimizer.param_groups[0]["lr"]
            out["counts"].append(trainer.loop.pipeline.schedule.num_microbatches)
            out["lr"].append((lr, lr_at(ramp.consumed_before(step) / 16, cfg.optim, ramp.consumed_before(steps) / 16)))
            ref_loss = reference.grads(step)
            for group in reference.opt.param_groups:
                group["lr"] = lr
            reference.opt.step()
            reference.opt.zero_grad()
            out["loss"] = max(out["loss"], abs(loss - ref_loss) / abs(ref_loss))
            out["param"] = max([out["param"]] + [scale_cases.rel_diff(a.detach(), b.detach()) for a, b in both])
            # the batch of a run whose data.batch_size is this step's size
            size = ramp.size(step)
            alone = build_batches(typed_data(OmegaConf.merge(cfg.data, {"batch_size": size})), cfg.model).train.get(step)
            ramped = reference.batches.train.get(step)
            out["sized"].append(size == len(ramped[1]) and all(torch.equal(a, b) for a, b in zip(alone, ramped)))
        # saved mid-ramp (step 3: 12 samples a step), resumed by train.resume=auto: the losses go on as above
        resumed = []
        for until in (3, steps):
            cfg = scale_cases.make_config(2, "1f1b", 4, data__batch_size=16, train__max_steps=until,
                                          train__batch_ramp=RAMP, train__save_every=3, train__resume="auto",
                                          train__run_dir=os.path.join(parent, "resumed"))
            again = build_run(cfg, torch.device("cpu"))
            trainers.append(again)
            again.fit()
            resumed += again.history
        out["resumed"] = max(abs(a - b) / abs(b) for a, b in zip(resumed, losses))
        out["resumed_steps"] = len(resumed)
        # schedule=auto: synthesised again for each count on the same stages; the same losses
        cfg = scale_cases.make_config(2, "auto", 4, data__batch_size=16, train__max_steps=5, train__batch_ramp=RAMP,
                                      train__run_dir=os.path.join(parent, "auto"))
        synthesized = build_run(cfg, torch.device("cpu"))
        trainers.append(synthesized)
        synthesized.fit()
        out["auto"] = max(abs(a - b) / abs(b) for a, b in zip(synthesized.history, losses))
        out["auto_counts"] = sorted(synthesized.batches.ramp_schedules) + [synthesized.plan.schedule.num_microbatches]
    finally:
        for trainer in trainers:
            trainer.close()
        _on_rank0(lambda: __import__("shutil").rmtree(parent, ignore_errors=True))
    return out


def _params(trainer: Any) -> dict[str, torch.Tensor]:
    return {f"{idx}.{name}": p.detach().clone() for s, stage in trainer.parts.stages.items()
            for layer, idx in zip(stage.module, trainer.ranges[s]) for name, p in layer.named_parameters()}


def spikes_skipped_and_rolled_back() -> dict[str, Any]:
    """An injected loss spike (the last stage's logits x 30 at one micro-batch of global rank 1,
    pp 2 x dp 2) under train.spike.action=skip: every rank names the step, its update is dropped
    (the parameters stay as they were), no earlier step is flagged; under rollback (saves every 4
    steps, the spike at step 10): the run goes back to step 8, skips batches 8..10 and ends where
    a run resumed from that checkpoint with those batches skipped ends; with max_rollbacks=0 the
    spike stops every rank with LossSpikeError."""
    import scale_cases
    from pipeflow.errors import LossSpikeError
    from pipeflow.run.builder import build_run
    from pipeflow.checkpoint.find import read_meta

    parent = _shared_dir()
    console = _listen()
    out: dict[str, Any] = {}
    trainers = []
    spike = {"action": "skip", "window": 20}

    def run(name: str, fault: str | None, steps: int, **overrides: Any) -> Any:
        if fault:
            os.environ["PIPEFLOW_FAULT_INJECT"] = fault
        try:
            cfg = scale_cases.make_config(2, "1f1b", 2, train__max_steps=steps, train__log_every=1,
                                          train__run_dir=os.path.join(parent, name), **overrides)
            trainer = build_run(cfg, torch.device("cpu"))
        finally:
            os.environ.pop("PIPEFLOW_FAULT_INJECT", None)
        trainers.append(trainer)
        return trainer

    try:
        trainer = run("skip", "spike:rank=1:step=12:stage=1", 13, train__spike=spike)
        out["injected"] = trainer.loop.faults is not None
        for step in range(12):
            trainer.train_step(step)
        before = _params(trainer)
        trainer.train_step(12)
        after = _params(trainer)
        out["skip_kept"] = all(torch.equal(before[k], after[k]) for k in before)
        out["skip_lines"] = [line for line in console.lines if "loss spike" in line]
        console.lines.clear()
        rolled = run("rollback", "spike:rank=1:step=10:stage=1", 12, train__save_every=4,
                     train__spike={**spike, "action": "rollback"})
        rolled.fit()
        out["rollback_lines"] = [line for line in console.lines if "spike" in line or "rolled back" in line]
        out["rollback_meta"] = read_meta(os.path.join(parent, "rollback", "checkpoints", "step_00000012"))["batches_skipped"]
        again = run("again", None, 12, train__save_every=4, train__spike={**spike, "action": "off"},
                    train__resume=os.path.join(parent, "rollback", "checkpoints", "step_00000008"))
        start = again.resume()
        again.spikes.batches_skipped = 3  # what the rollback promised: batches 8..10 skipped
        again._train(start)
        ours, theirs = _params(rolled), _params(again)
        out["rollback_equal"] = set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
        capped = run("capped", "spike:rank=1:step=9:stage=1", 12, train__save_every=4,
                     train__spike={**spike, "action": "rollback", "max_rollbacks": 0})
        try:
            capped.fit()
        except LossSpikeError as exc:
            out["capped"] = str(exc)
    finally:
        for trainer in trainers:
            trainer.close()
        _unlisten(console)
        _on_rank0(lambda: __import__("shutil").rmtree(parent, ignore_errors=True))
    return out


def stragglers_named() -> dict[str, Any]:
    """pp 2 on 2 ranks (no time-sharing of one core can make one rank slower than the other):
    an unthrottled run of 10 log intervals, then a run whose rank 1 sleeps 15 ms before every
    forward from step 15 (several times its compute). Rank 0: the straggler and slow-link lines
    of each, and each rank's compute per step as measured."""
    import scale_cases
    from pipeflow.run.builder import build_run

    parent = _shared_dir()
    console = _listen()
    out: dict[str, Any] = {}
    trainers = []
    try:
        # slowed after the intervals each ratio is calibrated on (steps 1-10): a slowdown inside
        # them is taken for the rank's own pace (a straggler from the start is the uncalibrated check's)
        for name, fault in (("clean", None), ("slowed", "slow:rank=1:step=15:ms=15")):
            console.lines.clear()
            if fault:
                os.environ["PIPEFLOW_FAULT_INJECT"] = fault
            try:
                cfg = scale_cases.make_config(1, "1f1b", 2, train__max_steps=50 if name == "clean" else 35,
                                              train__log_every=5, train__run_dir=os.path.join(parent, name),
                                              pipeline__profile=True)  # the compute each rank is held against
                trainer = build_run(cfg, torch.device("cpu"))
            finally:
                os.environ.pop("PIPEFLOW_FAULT_INJECT", None)
            trainers.append(trainer)
            trainer.fit()
            out[name] = [line for line in console.lines if "straggler:" in line or "slow link:" in line]
    finally:
        for trainer in trainers:
            trainer.close()
        _unlisten(console)
        _on_rank0(lambda: __import__("shutil").rmtree(parent, ignore_errors=True))
    return out
