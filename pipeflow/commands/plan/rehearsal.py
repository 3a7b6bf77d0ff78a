"""The planner's shortlist rehearsed on this host (``python -m pipeflow.plan plan.rehearse=<k>``).

A simulated ranking is only as good as its costs; where ranks share a host's cores the costs of
one layout say little about another's (a split backward's extra actions, a smaller micro-batch's
overheads, who computes beside whom).  So the planner can take its k fastest layouts (the best
split of each schedule x micro-batch count x stages per rank) and build each as ``train.py``
would, in dp x pp processes on this host: each run profiles, measures its transfers and tail,
and rehearses its own program on its first batch (`pipeflow.planning.rehearsal`), which gives
its start-of-run prediction of the whole step.  Those rehearsed steps re-rank the shortlist.
Nothing is trained or saved; the runs' directories are temporary.
"""
from __future__ import annotations

import datetime
import os
import shlex
import traceback
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipeflow.planning.rehearsal import rehearsal_steps
from pipeflow.planning.search import Candidate
from pipeflow.runtime.world.distributed import end_process_group, run_local_ranks

REHEARSED_STEPS = 1000  # a run this long rehearses; nothing is trained
# A run rehearses about 1.5 s a lowering before its own step 0 (up to 8 steps); the planner,
# which ranks layouts by a few per cent, rehearses each longer: 8 steps differed by up to 15%
# from the measured median step on the default GPT, 24 by up to 5% (benchmarks/predictions/planner_picks.py)
PLAN_BUDGET_S, PLAN_MOST_STEPS = 2.5, 24


def shortlist(candidates: Sequence[Candidate], k: int) -> list[int]:
    """Indices of the first `k` candidates that differ in (schedule, m, v): each the best
    predicted split of its kind."""
    seen, picks = set(), []
    for i, c in enumerate(candidates):
        kind = (c.schedule, c.num_microbatches, c.stages_per_rank)
        if kind not in seen and len(picks) < k:
            seen.add(kind)
            picks.append(i)
    return picks


def run_words(overrides: Sequence[str], pick: str, run_dir: str, predicted_s: float = 0.0) -> list[str]:
    """The overrides of a rehearsed layout's run: the planner's, the candidate's (`pick`,
    shell-quoted), a temporary run directory and what makes it rehearse (about
    :data:`PLAN_BUDGET_S` a lowering for a step predicted at `predicted_s`) and nothing else."""
    steps = rehearsal_steps(predicted_s, PLAN_BUDGET_S, PLAN_MOST_STEPS)
    return [*overrides, *shlex.split(pick), f"train.run_dir={run_dir}", "metrics.tensorboard=false",
            f"metrics.rehearse_steps={steps}", f"train.max_steps={REHEARSED_STEPS}", "train.resume=none",
            "dist.device=cpu"]


def rehearse_layouts(configs: Sequence[Any], world: int, timeout_s: float = 1800.0) -> list[float]:
    """The start-of-run prediction (seconds, the whole step) of each run config of `configs`
    (:func:`run_words` composed), built in `world` spawned gloo processes on this host.

    Raises:
        RuntimeError: a run could not be built (its error), a process died, or `timeout_s` passed.
    """
    try:
        answer = run_local_ranks(_worker, world, (world, list(configs)), timeout_s)
    except RuntimeError as exc:
        raise RuntimeError(f"plan.rehearse: {exc}") from exc
    if isinstance(answer, str):  # a rank's error, put on the queue in place of the steps
        raise RuntimeError(f"plan.rehearse: {answer}")
    return answer


def _worker(rank: int, port: int, results: Any, world: int, configs: list[Any]) -> None:
    """One rank of the rehearsals: build each layout's run (which rehearses it), keep its predicted step."""
    from pipeflow.run.builder import build_run

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1 for several ranks
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    steps: list[float] = []
    barrier_s: float | None = None  # after a failure, no barrier: a peer may never come
    try:
        for cfg in configs:
            trainer = build_run(cfg, torch.device("cpu"))
            steps.append(trainer.plan.layout.prediction.step_s)
            trainer.close()
            del trainer
        if rank == 0:
            results.put(steps)
        barrier_s = 300.0
    except Exception as exc:  # noqa: BLE001 - reported to the planner, which names it
        results.put(f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}")
    finally:  # every rank done (bounded) before any group goes, the runs' cycles collected first
        end_process_group(barrier_s)
