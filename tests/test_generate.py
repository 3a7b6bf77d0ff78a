"""Generation on the pipeline (issue 43), the parts one process can check: the built-in GPT's KV
cache and left padding against recomputing the whole sequence, sampling, prompts and options.
The pipelined cases (2 stages, against transformers' generate) run in test_hf's 2-process world
(tests/generate_cases.py)."""
from __future__ import annotations

import pytest
import torch

from pipeflow.errors import ConfigError
from pipeflow.models.gpt import build_gpt
from pipeflow.models.gpt_decode import GPTStageDecoder
from pipeflow.models.spec import run_layers
from pipeflow.commands.generate import parse_options, run_config, split
from pipeflow.runtime.decode import Sampler, generate, left_padded

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [12, 13, 14, 1], [30]]


def _gpt():
    spec = build_gpt(vocab_size=64, block_size=32, n_layer=3, n_head=4, n_embd=32, seed=3)
    layers = [layer.eval() for layer in spec.build_layers(range(len(spec.layers)), "cpu", torch.float64)]
    return layers, GPTStageDecoder(dict(enumerate(layers)), len(layers), 32)


def test_gpt_cached_batched_greedy_equals_recomputing_each_prompt_alone():
    layers, decoder = _gpt()
    expected = []
    for prompt in PROMPTS:  # no cache, no padding: the whole sequence through the model's own forward
        ids = torch.tensor([prompt])
        for _ in range(6):
            with torch.no_grad():
                ids = torch.cat([ids, run_layers(layers, ids)[:, -1].argmax(-1, keepdim=True)], 1)
        expected.append(ids[0, len(prompt):].tolist())
    for batch_size, in_flight in ((3, 0), (4, 1), (1, 2)):
        batches = [left_padded(PROMPTS[k:k + batch_size], 0, 6, decoder.context)
                   for k in range(0, len(PROMPTS), batch_size)]
        made = generate(decoder, batches, Sampler(), (), 0, in_flight=in_flight)
        assert [row for batch in made for row in batch] == expected, (batch_size, in_flight)


def test_sampling_is_reproducible_by_seed_and_a_tiny_top_p_is_greedy():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    draws = [Sampler(1.0, 0.95, seed)(logits).tolist() for seed in (1, 1, 2)]
    assert draws[0] == draws[1] and draws[0] != draws[2]
    assert Sampler(0.7, 1e-6, 5)(logits).tolist() == logits.argmax(-1).tolist()
    assert Sampler()(logits).tolist() == logits.argmax(-1).tolist()


def test_an_eos_list_stops_each_row_and_the_context_caps_the_steps():
    layers, decoder = _gpt()
    batch = left_padded(PROMPTS, 0, 6, decoder.context)
    greedy = generate(decoder, [batch], Sampler(), (), 0)[0]
    eos = (greedy[0][1], greedy[3][3])
    stopped = generate(decoder, [left_padded(PROMPTS, 0, 6, decoder.context)], Sampler(), eos, 0)[0]
    for row, full in zip(stopped, greedy):
        first = next((k for k, t in enumerate(full) if t in eos), None)
        assert row == (full if first is None else full[:first + 1])
    assert left_padded([[1] * 30], 0, 10, 32).steps == 2  # 30 + 2 = the 32 positions
    with pytest.raises(ConfigError, match="context"):
        left_padded([[1] * 32], 0, 10, 32)


def test_options_and_the_stage_split():
    options, rest = parse_options(["model=hf", "generate.prompts=p.txt", "generate.temperature=0.5",
                                   "generate.eos_token_id=[2, 7]", "train.resume=x"])
    assert (options.prompts, options.temperature, options.eos_token_id) == ("p.txt", 0.5, [2, 7])
    assert rest == ["model=hf", "train.resume=x"]
    for bad in (["generate.tempreature=1"], ["generate.top_p=0"], ["generate.chat=yes please"],
                ["generate.max_new_tokens=3.5"], ["generate.eos_token_id=[2, x]"]):
        with pytest.raises(ConfigError):
            parse_options(bad)
    assert split(6, 4) == [range(0, 1), range(1, 3), range(3, 4), range(4, 6)]
    with pytest.raises(ConfigError, match="at most 6"):
        split(6, 7)
    # issue 57: YAML reads 1e-30 as text; it is a float all the same
    assert parse_options(["generate.temperature=1e-30"])[0].temperature == 1e-30
    # issue 59: context parallelism is for training; generation splits layers, not sequences
    with pytest.raises(ConfigError, match=r"^parallel.cp=2: generation splits the model's layers"):
        run_config(["parallel.cp=2", "train.resume=x"])


def test_prompts_that_cannot_be_generated_from_are_named(tmp_path):
    """Issue 57: an empty prompts file was rc 0 with no output; a token id outside the vocabulary a
    raw IndexError."""
    from omegaconf import OmegaConf

    from pipeflow.commands.generate import Prompts, read_prompts

    (tmp_path / "empty.txt").write_text("\n  \n")
    with pytest.raises(ConfigError, match=r"generate.prompts='.*empty.txt' holds no prompt"):
        read_prompts(str(tmp_path / "empty.txt"))
    (tmp_path / "p.txt").write_text("1 2\n\n3\n")
    assert read_prompts(str(tmp_path / "p.txt")) == ["1 2", "3"]
    options, _ = parse_options([f"generate.prompts={tmp_path / 'p.txt'}"])
    prompts = Prompts(OmegaConf.create({"model": {"vocab_size": 64}}), options, hf=False)
    assert prompts.encode("0 63") == [0, 63]
    with pytest.raises(ConfigError, match=r"prompt '3 64' has token id 64, outside the model's vocabulary 0..63 "
                                          r"\(model.vocab_size=64\)"):
        prompts.encode("3 64")
    with pytest.raises(ConfigError, match=r"token id -1"):
        prompts.encode("-1 2")


def test_the_runs_saved_config_is_read_and_overrides_apply_on_top(tmp_path):
    import json

    from omegaconf import OmegaConf

    from pipeflow.commands.generate import run_config
    from pipeflow.commands.plan.command import compose_config

    step = tmp_path / "run" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 4}))
    OmegaConf.save(compose_config(["model.n_layer=3"]), tmp_path / "run" / "config.yaml")
    cfg, path = run_config([f"train.resume={tmp_path / 'run'}", "model.n_head=2", "model=gpt"])
    assert path == str(step) and cfg.train.resume == str(step)
    assert (cfg.model.n_layer, cfg.model.n_head) == (3, 2)
    with pytest.raises(ConfigError, match=r"no model\.n_layr"):
        run_config([f"train.resume={tmp_path / 'run'}", "model.n_layr=2"])
    with pytest.raises(ConfigError, match="train.run_dir"):
        run_config(["train.resume=auto"])
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        run_config([f"train.resume={tmp_path}/nothing"])
