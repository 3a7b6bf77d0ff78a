"""``parallel.replan=true`` (issue 61): the degrees chosen for the world that met, within the
memory each rank has; a world too small named with the ranks it would need; and in a 2-rank
world (tests/test_faults.py's, :mod:`replan_cases`) a run that plans, keeps its profile and plan
in the run directory, and a restart that takes the kept plan."""
from __future__ import annotations

import pytest

from pipeflow.errors import ConfigError
from pipeflow.planning.profile import LayerProfile
from pipeflow.commands.plan.command import compose_config
from pipeflow.run.replan import best_degrees, replanned


def _costs(b: int) -> list[LayerProfile]:
    """Four equal layers of 100 MB of parameters each, whose time and activations grow with b."""
    return [LayerProfile(f"l{i}", 25_000_000, 100_000_000, 1e-3 * b, 2e-3 * b, 1_000_000 * b, 1e-3 * b, 1e-3 * b,
                         4000 * b) for i in range(4)]


def _config(*words: str):
    return compose_config(["model=gpt", "model.n_layer=2", "data.batch_size=16", "pipeline.num_microbatches=4",
                           "parallel.replan=true", "parallel.pp=auto", "parallel.dp=auto", "plan.comm_latency_ms=0",
                           *words])


def test_replan_takes_the_fastest_layout_that_fits_each_ranks_memory() -> None:
    cfg = _config()
    # no limit: 4 replicas of the whole model beat any pipeline (no bubble)
    assert best_degrees(_costs, cfg, 4, None).shape() == "dp 4 x pp 1 x tp 1"
    # 400 MB of weights and 800 MB of AdamW state on one rank do not fit 1 GB: split in two or four
    fits = best_degrees(_costs, cfg, 4, 1e9)
    assert fits.pp >= 2 and fits.dp * fits.pp == 4 and fits.peak_bytes <= 1e9, fits
    assert best_degrees(_costs, cfg, 4, 0.45e9).shape() == "dp 1 x pp 4 x tp 1"  # one layer per rank


def test_a_world_too_small_for_the_model_is_named_with_the_ranks_it_needs() -> None:
    cfg = _config()
    assert best_degrees(_costs, cfg, 2, 0.45e9) is None
    from pipeflow.run.replan import _too_small

    text = _too_small(_costs, cfg, 2, 0.45e9)
    assert text.startswith("parallel.replan: no layout of 2 ranks holds the model within 0.45 GB per rank "
                           "(plan.memory_limit_gb); it needs at least 4 ranks of that memory (dp 1 x pp 4 x tp 1"), text
    assert "the last checkpoint is left as it was" in text


def test_auto_degrees_need_replan_and_a_fixed_dp_must_fit() -> None:
    with pytest.raises(ConfigError, match=r"^parallel.pp=auto is chosen at each start by re-planning: add "
                                          r"parallel.replan=true"):
        replanned(compose_config(["parallel.pp=auto"]), None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^parallel.tp=auto is chosen when a run starts"):
        from pipeflow.config.schema import tensor_degree

        tensor_degree(compose_config(["parallel.tp=auto"]).parallel)
    fixed = _config("parallel.dp=2")
    assert best_degrees(_costs, fixed, 4, None).shape() == "dp 2 x pp 2 x tp 1"  # dp given: pp takes the rest


def test_replan_refuses_context_and_expert_parallelism_by_name() -> None:
    import torch

    with pytest.raises(ConfigError, match=r"^parallel.replan plans dp x pp x tp; with parallel.cp=2 \(context "):
        replanned(_config("parallel.cp=2"), torch.device("cpu"))


def test_a_kept_plan_stands_only_for_the_same_memory_limit(tmp_path) -> None:
    """The plan kept per world size is re-made when plan.memory_limit_gb changes (the profile is kept)."""
    import torch

    from pipeflow.run.replan import _plan

    words = ["model.n_embd=16", "model.n_head=2", "data.seq_len=16", "plan.repeats=1", f"train.run_dir={tmp_path}"]
    first, said = _plan(_config(*words), 4, torch.device("cpu"))
    assert "(planned on the profile kept in the run directory)" in said, said
    again, said = _plan(_config(*words), 4, torch.device("cpu"))
    assert again == first and "(the plan kept for this world size)" in said, said
    limit = f"plan.memory_limit_gb={first.peak_bytes * 10 / 1e9}"  # a limit the first plan meets too
    limited, said = _plan(_config(*words, limit), 4, torch.device("cpu"))
    assert "(planned on the profile kept" in said and limited.peak_bytes <= first.peak_bytes * 10, (said, limited)
