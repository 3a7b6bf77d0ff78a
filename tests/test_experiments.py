"""configs/experiment/*.yaml: every recipe composes into a valid job for its own world size."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra.utils import instantiate

from pipeflow.run.config import check_config
from pipeflow.planning.partition import plan_partition
from pipeflow.run.plan import compose_config
from pipeflow.schedules import build_schedule, simulate

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml"))


def test_there_are_recipes() -> None:
    assert {"gpt_small_pp4_zbv", "gpt_small_pp4_1f1b", "mlp_pp2_gpipe", "resnet18_pp4",
            "llama_tiny_pp4"} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_composes_into_a_valid_config(name: str, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)  # paths in recipes (llama_tiny_pp4's model.path) are the repository's
    cfg = compose_config([f"experiment={name}"])
    pp = cfg.parallel.pp
    assert pp is not None, f"{name}: a recipe names its pipeline size (parallel.pp)"
    assert check_config(cfg, world_size=pp) == (1, pp)
    schedule = build_schedule(cfg.schedule.name, pp, cfg.pipeline.num_microbatches, cfg.pipeline.stages_per_rank,
                              cfg.pipeline.placement, cfg.schedule.path, cfg.pipeline.stage_to_rank)
    simulate(schedule)  # the schedule is valid for these sizes
    spec = instantiate(cfg.model)
    ranges = plan_partition(spec, schedule.num_stages, "uniform", cfg.pipeline.split_points)
    assert sum(len(r) for r in ranges) == len(spec)


def test_recipe_values_can_still_be_overridden() -> None:
    cfg = compose_config(["experiment=gpt_small_pp4_zbv", "pipeline.num_microbatches=8", "schedule=1f1b"])
    assert (cfg.schedule.name, cfg.pipeline.num_microbatches, cfg.model.n_embd) == ("1f1b", 8, 128)
    offline = compose_config(["experiment=resnet18_pp4", "data=fakedata"])
    assert offline.data.name == "fakedata" and offline.model.arch == "resnet18"
