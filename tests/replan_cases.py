"""``parallel.replan=true`` on 2 gloo ranks (issue 61), run inside tests/test_faults.py's world:
a run that plans its degrees for the world, keeps its profile and plan in the run directory and
trains; its restart takes the kept plan and resumes; a memory limit no layout of 2 ranks meets
is named on every rank with the ranks it would need, before anything is written.

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
            out[f"mesh{steps}"] = (trainer.mesh.dp, trainer.mesh.pp)
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


WORLD_CASES = [("replan", replanning_runs)]


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
