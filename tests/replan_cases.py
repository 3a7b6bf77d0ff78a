"""``parallel.replan=true`` on 2 gloo ranks (issue 61), run inside tests/test_faults.py's world:
a run that plans its degrees for the world, keeps its profile and plan in the run directory and
trains; its restart takes the kept plan and resumes; a memory limit no layout of 2 ranks meets
is named on every rank with the ranks it would need, before anything is written; dropout draws
the same masks on every layout.

Not collected on its own: the ``test_*`` functions below are imported by test_faults.py.
"""
from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import torch

from fault_cases import _error, _Logged, _on_rank0, _shared_dir


def replanning_runs() -> dict[str, Any]:
    """Plan, train 2 steps and save; start again (resume=auto, 4 steps) on the kept plan; then a
    limit too small for 2 ranks."""
    import scale_cases
    from pipeflow.run.builder import build_run

    parent = _shared_dir()
    run_dir = os.path.join(parent, "run")
    logged, logger = _Logged(), logging.getLogger("pipeflow")
    level = logger.level
    logger.addHandler(logged)
    logger.setLevel(logging.INFO)
    out: dict[str, Any] = {}
    trainers = []
    try:
        for steps in (2, 4):
            cfg = scale_cases.make_config(1, "1f1b", 2, train__run_dir=run_dir, train__max_steps=steps,
                                          train__save_every=2, train__resume="auto", parallel__replan=True,
                                          parallel__pp="auto", parallel__dp="auto", plan__comm_latency_ms=0.1)
            trainer = build_run(cfg, torch.device("cpu"))
            trainers.append(trainer)
            trainer.fit()
            out[f"mesh{steps}"] = (trainer.topology.mesh.dp, trainer.topology.mesh.pp)
            out[f"trained{steps}"] = len(trainer.history)
        out["lines"] = [line for line in logged.lines if line.startswith("re-planned")]
        out["kept"] = sorted(os.listdir(os.path.join(run_dir, "replan")))
        tiny = scale_cases.make_config(1, "1f1b", 2, train__run_dir=os.path.join(parent, "tiny"), train__max_steps=2,
                                       parallel__replan=True, parallel__pp="auto", parallel__dp="auto",
                                       plan__memory_limit_gb=1e-5)
        out["tiny"] = _error(lambda: build_run(tiny, torch.device("cpu")))
    finally:
        logger.removeHandler(logged)
        logger.setLevel(level)
        for trainer in trainers:
            trainer.close()
        _on_rank0(lambda: shutil.rmtree(parent, ignore_errors=True))
    return out


def dropout_runs() -> dict[str, list[float]]:
    """3 steps of a GPT with dropout 0.2 (checkpointed layers, recomputed in backward) on three
    layouts of 2 ranks, masks keyed by sample (the default), and once on each rank's generator."""
    import scale_cases
    from pipeflow.run.builder import build_run

    layouts = {"pp2": (1, 2, {}), "dp2": (2, 2, {}), "tp2": (1, 4, {"parallel__tp": 2}),
               "pp2-rank": (1, 2, {"train__dropout_rng": "rank"})}
    out = {}
    for name, (dp, m, extra) in layouts.items():
        cfg = scale_cases.make_config(dp, "1f1b", m, model__dropout=0.2, pipeline__checkpoint_activations=True,
                                      metrics__tensorboard=False, **extra)
        trainer = build_run(cfg, torch.device("cpu"))
        try:
            trainer.fit()
            out[name] = list(trainer.history)
        finally:
            trainer.close()
    return out


def folders_passed() -> dict[str, Any]:
    """Each rank sends a folder of files (one empty, one of several messages) to the other while
    receiving the other's (the copies of ``train.checkpoint_replicas``), then rank 1 broadcasts
    its own (a restart's assembly); what arrived, read back."""
    import torch.distributed as dist
    from pipeflow.checkpoint import replicas

    rank = dist.get_rank()
    parent = _shared_dir()
    mine = os.path.join(parent, f"from{rank}")
    os.makedirs(os.path.join(mine, "rng"))
    files = {"__0_0.distcp": bytes(range(256)) * (40 + rank), "rng/rank0.pt": b"", "meta.json": b"{}"}
    for rel, data in files.items():
        with open(os.path.join(mine, rel), "wb") as f:
            f.write(data)
    chunk, replicas.CHUNK = replicas.CHUNK, 1000  # 10-11 messages for the big file
    try:
        into = os.path.join(parent, f"got{rank}")
        replicas.pass_folder(mine, 1 - rank, into, 1 - rank, None)
        cast = os.path.join(parent, f"cast{rank}")
        replicas._broadcast_folder(mine if rank == 1 else None, 1, cast, None)
    finally:
        replicas.CHUNK = chunk

    def read(folder: str) -> dict[str, bytes]:
        return {rel: open(os.path.join(folder, rel), "rb").read() for rel in files}

    out = {"got": read(into), "cast": read(cast) if rank == 0 else None}
    dist.barrier()
    _on_rank0(lambda: shutil.rmtree(parent, ignore_errors=True))
    return out


WORLD_CASES = [("replan", replanning_runs), ("keyed-dropout", dropout_runs), ("folders-passed", folders_passed)]


def _values(results: list) -> list:
    errors = [f"rank {r}: {res.error}" for r, res in enumerate(results) if res.error is not None]
    assert not errors, "\n".join(errors)
    return [res.value for res in results]


def test_a_replanning_run_chooses_its_degrees_keeps_its_plan_and_restarts_on_it(world) -> None:
    outs = _values(world["replan"])
    first = outs[0]
    assert first["mesh2"] in ((2, 1), (1, 2)) and first["mesh4"] == first["mesh2"], first
    assert first["trained2"] == 2 and first["trained4"] == 2, first  # the restart resumed at step 2
    lines = first["lines"]
    assert len(lines) == 2 and lines[0].startswith("re-planned for 2 ranks: dp "), lines
    assert "(planned on the profile kept in the run directory)" in lines[0], lines
    assert "(the plan kept for this world size)" in lines[1], lines
    assert first["kept"] == ["plans.json", "profile.json"], first
    for out in outs:  # every rank names rank 0's finding, before anything is built (the ranks it would
        # need: tests/test_replan.py; this model fits no world in 10 kB)
        assert out["tiny"] == outs[0]["tiny"], outs
        assert out["tiny"].startswith("ConfigError: parallel.replan: no layout of up to 24 ranks holds the model "
                                      "within 1e-05 GB per rank (plan.memory_limit_gb)"), out["tiny"]


def test_dropout_draws_the_same_masks_on_every_layout(world) -> None:
    """Keyed by sample and layer: pp 2, dp 2 and tp 2 (2 and 4 micro-batches, recomputed layers)
    give one loss series; each rank's own generator (train.dropout_rng=rank) another."""
    import math

    runs = _values(world["keyed-dropout"])[0]  # the losses are every rank's (all-reduced)
    assert len(runs["pp2"]) == 3, runs
    for name in ("dp2", "tp2"):
        assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(runs[name], runs["pp2"])), runs
    assert any(not math.isclose(a, b, rel_tol=1e-6) for a, b in zip(runs["pp2-rank"][1:], runs["pp2"][1:])), runs


def test_a_folder_travels_between_ranks_a_chunk_at_a_time(world) -> None:
    """Rank 0 gets rank 1's files and rank 1 rank 0's, in both directions at once, sizes intact
    (the big file in 11 messages, the empty one as an empty file); a broadcast reaches rank 0."""
    outs = _values(world["folders-passed"])
    for rank, out in enumerate(outs):
        sent = {"__0_0.distcp": bytes(range(256)) * (41 - rank), "rng/rank0.pt": b"", "meta.json": b"{}"}
        assert out["got"] == sent, {rel: len(data) for rel, data in out["got"].items()}
    assert outs[0]["cast"] == outs[0]["got"]
