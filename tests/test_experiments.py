"""configs/experiment/*.yaml: every recipe composes into a valid job for its own world size; and
examples/llama_end_to_end.sh runs (text -> tokenizer and shards -> model=hf on 2 ranks -> export
--format hf -> from_pretrained -> generate)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.utils import instantiate
from warm_exec import interpreters

from pipeflow.config.schema import check_config
from pipeflow.planning.partition import plan_partition
from pipeflow.commands.plan.command import compose_config
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
    dp = cfg.parallel.dp if isinstance(cfg.parallel.dp, int) else 1  # moe_tiny_pp2_ep2: dp 2 (= ep) x pp 2
    assert check_config(cfg, world_size=dp * pp) == (dp, pp)
    schedule = build_schedule(cfg.schedule.name, pp, cfg.pipeline.num_microbatches, cfg.schedule.stages_per_rank,
                              cfg.schedule.placement, cfg.schedule.path, cfg.schedule.stage_to_rank)
    simulate(schedule)  # the schedule is valid for these sizes
    spec = instantiate(cfg.model)
    ranges = plan_partition(spec, schedule.num_stages, "uniform", cfg.pipeline.split_points)
    assert sum(len(r) for r in ranges) == len(spec)


def test_recipe_values_can_still_be_overridden() -> None:
    cfg = compose_config(["experiment=gpt_small_pp4_zbv", "pipeline.num_microbatches=8", "schedule=1f1b"])
    assert (cfg.schedule.name, cfg.pipeline.num_microbatches, cfg.model.n_embd) == ("1f1b", 8, 128)
    offline = compose_config(["experiment=resnet18_pp4", "data=fakedata"])
    assert offline.data.name == "fakedata" and offline.model.arch == "resnet18"


def _example_whose_loss_falls(script: str, work: Path, steps: int) -> str:
    """Run ``examples/<script>`` in `work` for `steps` steps; its output, once it exited 0 and its
    run's final line says the loss fell."""
    env = {**os.environ, "WORK": str(work), "STEPS": str(steps), **interpreters(launchers=True)}
    run = subprocess.run(["bash", str(ROOT / "examples" / script)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    first, last = map(float, re.search(r"INFO loss (\S+) -> (\S+)", out).groups())
    assert last < first, out[-4000:]
    return out


def test_llama_end_to_end_example_runs(tmp_path: Path) -> None:
    """examples/llama_end_to_end.sh, 10 steps (about 20 s on two cores): every step's output is
    there, the loss falls, and the exported folder loads and generates after the prompt."""
    out = _example_whose_loss_falls("llama_end_to_end.sh", tmp_path, steps=10)
    assert "greedy: 'Alice was" in out and "tokenizer of 512 tokens" in out
    for name in ("tokens/tokenizer.json", "tokens/prepare.json", "run/checkpoints", "hf/config.json",
                 "hf/model.safetensors", "hf/tokenizer.json"):
        assert (tmp_path / name).exists(), name


def test_lora_finetune_example_runs(tmp_path: Path) -> None:
    """examples/finetune_lora.sh, 40 steps: chat data prepared, a LoRA fine-tune on 2 pipeline
    ranks whose loss falls, and both exports loaded by transformers and peft with one set of logits;
    python -m pipeflow.generate before (the base, one process) and after (the run's LoRA checkpoint,
    2 pipeline ranks), the answer after equal to transformers' greedy one on the merged export."""
    pytest.importorskip("peft")
    out = _example_whose_loss_falls("finetune_lora.sh", tmp_path, steps=40)
    assert re.search(r"trainable [\d.]+ K of [\d.]+ K", out), out[-4000:]
    difference = float(re.search(r"largest logit difference (\S+)", out).group(1))
    assert difference < 1e-4, out[-2000:]  # float32: the adapter over the base and the merged weights agree
    assert "what is two plus three ->" in out
    answers = re.findall(r"^'(.+)': before '(.*)' -> after '(.*)'$", out, re.M)
    assert len(answers) == 3 and any(before != after for _, before, after in answers), out[-2000:]
    for name in ("chat/prepare.json", "adapter/adapter_config.json", "merged/config.json", "before.jsonl",
                 "after.jsonl"):
        assert (tmp_path / name).exists(), name
