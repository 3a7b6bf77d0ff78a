"""Cases run inside test_hf's 2-process gloo world (see mp_harness): generation on a 2-stage pipeline
(:mod:`pipeflow.runtime.decode`) against ``transformers``' ``generate`` on the unsplit model, and
``python -m pipeflow.generate``'s main from a saved checkpoint and its config.yaml."""
from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [12, 13, 14, 1], [30]]  # different lengths: left padding
STEPS = 8


def _stage(folder: str) -> Any:
    from pipeflow.models.hf import build_hf
    from pipeflow.models.hf_decode import HFStageDecoder
    from pipeflow.models.hf_folder import load_config
    from pipeflow.commands.generate import split

    spec = build_hf(folder)
    mine = split(len(spec.layers), dist.get_world_size())[dist.get_rank()]
    layers = {i: layer.eval() for i, layer in zip(mine, spec.build_layers(mine, "cpu", torch.float64))}
    return HFStageDecoder(load_config(folder), layers)


def pipeline_vs_hf_generate(folder: str, kind: str) -> dict[str, Any] | None:
    """Greedy on the pipeline (batched, several micro-batches in flight; and one prompt at a time)
    against Hugging Face's greedy ``generate``; sampling by seed; a list of end-of-sequence ids.
    Returns (rank 0) the token lists to compare, None elsewhere."""
    import transformers

    import test_hf
    from pipeflow.runtime.decode import Sampler, generate, left_padded
    from pipeflow.runtime.transport import P2PComm

    decoder, comm = _stage(folder), P2PComm(None, torch.device("cpu"))

    def run(batch_size: int, in_flight: int, sampler: Sampler, eos: tuple = ()) -> list | None:
        batches = [left_padded(PROMPTS[k:k + batch_size], 0, STEPS, decoder.context)
                   for k in range(0, len(PROMPTS), batch_size)]
        made = generate(decoder, batches, sampler, eos, 0, comm, torch.float64, in_flight)
        return None if made is None else [row for batch in made for row in batch]

    out = {"batched": run(3, 0, Sampler()), "one_at_a_time": run(1, 1, Sampler()),
           "sampled": [run(2, 0, Sampler(1.0, 0.9, seed)) for seed in (7, 7, 8)]}
    if dist.get_rank() != 0:
        run(3, 0, Sampler(), (0, 0))  # the EOS case: stage 0 chose the ids
        return None
    greedy = out["batched"]
    out["eos_ids"] = (greedy[0][2], greedy[2][4])
    out["eos"] = run(3, 0, Sampler(), out["eos_ids"])
    ref = test_hf.reference(kind, folder).to(torch.float64)
    ref.generation_config.eos_token_id = None
    out["hf"] = [ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              do_sample=False, max_new_tokens=STEPS, pad_token_id=0)[0, len(p):].tolist()
                 for p in PROMPTS]
    return out


def generate_command_from_checkpoint(folder: str, run_dir: str) -> dict[str, Any] | None:
    """``pipeflow.generate``'s main with ``train.resume=<checkpoint>`` alone (its run's config.yaml
    read) on weights scaled by 0.9 before the save, against Hugging Face's generate on the same
    weights; the completions as the JSON lines it wrote (rank 0)."""
    import transformers
    from omegaconf import OmegaConf

    import chat_fixtures as fx
    from pipeflow.checkpoint import saving as checkpoint
    from pipeflow.commands.generate import main
    from pipeflow.commands.plan.command import compose_config

    decoder = _stage(folder)
    with torch.no_grad():
        for layer in decoder.layers.values():
            for p in layer.parameters():
                p.mul_(0.9)
    params = [p for layer in decoder.layers.values() for p in layer.parameters()]
    if dist.get_rank() == 0:
        os.makedirs(run_dir, exist_ok=True)
        fx.write_tokenizer(os.path.join(run_dir, "tokenizer"))
        cfg = compose_config(["model=hf", f"model.path={folder}", "train.dtype=float64", "data=chat",  # a chat run's
                              f"data.path={run_dir}/chats.jsonl", f"data.tokenizer={os.path.join(run_dir, 'tokenizer')}"])
        OmegaConf.save(cfg, os.path.join(run_dir, "config.yaml"))
        with open(os.path.join(run_dir, "prompts.txt"), "w") as f:
            f.write("hello how are you\nwhat is two plus three\n")
    dist.barrier()
    path = checkpoint.save(os.path.join(run_dir, "checkpoints"), 1, decoder.layers, torch.optim.AdamW(params),
                           {"dp": 1, "pp": 2, "tp": 1})
    out_file, chat_file = os.path.join(run_dir, "out.jsonl"), os.path.join(run_dir, "chat.jsonl")
    given = [f"train.resume={path}", f"generate.prompts={os.path.join(run_dir, 'prompts.txt')}",
             "generate.max_new_tokens=5"]
    code = main(given + [f"generate.output={out_file}", "generate.batch_size=1"])
    code += main(given + [f"generate.output={chat_file}", "generate.chat=true"])  # both prompts in one micro-batch
    if dist.get_rank() != 0:
        return {"code": code}
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.join(run_dir, "tokenizer"))
    ref = transformers.LlamaForCausalLM.from_pretrained(folder).to(torch.float64)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.9)
    expected: dict[str, list] = {"plain": [], "chat": []}  # the model's own end-of-sequence id (config.json's) stops both
    for line in ("hello how are you", "what is two plus three"):
        chat = tokenizer.apply_chat_template([{"role": "user", "content": line}], add_generation_prompt=True,
                                             return_dict=True)["input_ids"]
        for kind, ids in (("plain", tokenizer(line)["input_ids"]), ("chat", chat)):
            ids = torch.tensor([list(ids)])
            new = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=5,
                               pad_token_id=0)[0, ids.shape[1]:]
            expected[kind].append({"prompt": line, "completion": tokenizer.decode(new, skip_special_tokens=True)})
    written = {}
    for kind, file in (("plain", out_file), ("chat", chat_file)):
        with open(file) as f:
            written[kind] = [json.loads(line) for line in f]
    return {"code": code, "written": written, "expected": expected}


def generate_from_a_lora_checkpoint(folder: str, run_dir: str) -> dict[str, Any] | None:
    """``pipeflow.generate``'s main on a LoRA run's checkpoint (adapters only, the base named;
    ``lora_B`` seeded so the adapters change the model) against Hugging Face's greedy generate on
    the unsplit model with peft's adapters merged in (float64); and the base alone, and a config
    without ``model.lora``, which main refuses (exit 1 on every rank)."""
    import transformers
    from omegaconf import OmegaConf
    from peft import inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    import chat_fixtures as fx
    import lora_cases
    from pipeflow.checkpoint import saving as checkpoint, lora_base
    from pipeflow.run.builder import build_spec
    from pipeflow.commands.generate import main, split
    from pipeflow.commands.plan.command import compose_config

    tokenizer_dir = os.path.join(run_dir, "tokenizer")
    cfg = compose_config(["model=hf", f"model.path={folder}", "train.dtype=float64", "data=chat",  # a chat run's
                          f"data.path={run_dir}/chats.jsonl", f"data.tokenizer={tokenizer_dir}"])
    OmegaConf.update(cfg, "model.lora", dict(lora_cases.LORA), merge=True)
    spec = build_spec(cfg.model)
    mine = split(len(spec.layers), dist.get_world_size())[dist.get_rank()]
    layers = dict(zip(mine, spec.build_layers(mine, "cpu", torch.float64)))
    lora_cases._set_lora_b([(n, p) for layer in layers.values() for n, p in layer.named_parameters()])
    if dist.get_rank() == 0:
        os.makedirs(run_dir, exist_ok=True)
        fx.write_tokenizer(tokenizer_dir)
        OmegaConf.save(cfg, os.path.join(run_dir, "config.yaml"))
        with open(os.path.join(run_dir, "prompts.txt"), "w") as f:
            f.write("hello how are you\nwhat is two plus three\n")
    dist.barrier()
    adapters = [p for layer in layers.values() for p in layer.parameters() if p.requires_grad]
    path = checkpoint.save(os.path.join(run_dir, "checkpoints"), 1, lora_base.trainable(layers),
                           torch.optim.AdamW(adapters), {"dp": 1, "pp": 2, "tp": 1,
                                                         lora_base.LORA_BASE: lora_base.record(cfg.model)})
    out_file = os.path.join(run_dir, "out.jsonl")
    given = [f"generate.prompts={os.path.join(run_dir, 'prompts.txt')}", "generate.max_new_tokens=6"]
    code = main([f"train.resume={path}", f"generate.output={out_file}"] + given)
    refused = main([f"train.resume={path}", "model.lora.rank=0"] + given)
    if dist.get_rank() != 0:
        return {"code": code, "refused": refused}
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    ref = transformers.LlamaForCausalLM.from_pretrained(folder).to(torch.float64)
    base = transformers.LlamaForCausalLM.from_pretrained(folder).to(torch.float64)
    ref = inject_adapter_in_model(spec.lora.peft_config(), ref)
    with torch.no_grad():  # every layer's adapters as the pipeline built them, lora_B seeded alike
        for layer in spec.build_all(dtype=torch.float64):
            for name, p in layer.named_parameters():
                if p.requires_grad:
                    ref.get_parameter(name).copy_(p)
    lora_cases._set_lora_b(ref.named_parameters())
    for module in ref.modules():
        if isinstance(module, LoraLayer):
            module.merge()
    expected: dict[str, list] = {"lora": [], "base": []}
    for line in ("hello how are you", "what is two plus three"):
        ids = torch.tensor([tokenizer(line)["input_ids"]])
        for kind, model in (("lora", ref), ("base", base)):
            new = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                                 pad_token_id=0)[0, ids.shape[1]:]
            expected[kind].append({"prompt": line, "completion": tokenizer.decode(new, skip_special_tokens=True)})
    with open(out_file) as f:
        written = [json.loads(line) for line in f]
    return {"code": code, "refused": refused, "written": written, "expected": expected}
