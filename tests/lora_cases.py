"""model.lora cases for test_hf's multi-process worlds: the real Trainer (``build_run``, model=hf with
LoRA through peft) against the unsplit model that ``peft.inject_adapter_in_model`` adapts, float64.

Both start from the same adapters: the pipelined layers' own (drawn under each layer's seed, which
every rank can build, so the reference takes every layer's from ``spec.build_all()``), with each
``lora_B`` (peft's zeros) set to the same seeded random values, so the first step's ``lora_A``
gradients are not zero.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from omegaconf import OmegaConf

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["q_proj", "v_proj", "down_proj"]}


def _seeded(name: str, like: torch.Tensor) -> torch.Tensor:
    """A value for adapter `name`, the same in every process."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)) * 7919)
    return 0.1 * torch.randn(like.shape, generator=gen, dtype=torch.float64).to(like.dtype)


def _set_lora_b(named: Any) -> None:
    with torch.no_grad():
        for name, p in named:
            if ".lora_B." in name:
                value = _seeded(name, p)
                if isinstance(p, DTensor):  # parallel.shard=full: this rank's shard of it
                    value = distribute_tensor(value, p.device_mesh, p.placements)
                p.copy_(value)


def trainer_vs_peft(folder: str, kind: str, run_dir: str, dp: int, schedule: str, m: int = 2, steps: int = 2,
                    resume_dp: bool = False, lora_targets: tuple[str, ...] = (), **overrides: Any) -> dict:
    """Worst relative differences of loss, trainable gradients and parameters over `steps` AdamW steps;
    and what the frozen base holds: gradients, optimizer state, parameters handed to the optimizer.
    With `resume_dp`, the run's checkpoint resumed by a dp = world, pp = 1 run: its adapters against
    the reference's trained ones."""
    import torch.distributed as dist
    import transformers
    from peft import inject_adapter_in_model

    from pipeflow.data import build_batches
    from pipeflow.models.module_spec import cross_entropy
    from pipeflow.run.builder import build_run, build_spec
    from pipeflow.run.trainer import lr_at
    from pipeflow.runtime.parallel.fsdp import local
    from pipeflow.runtime.parallel.zero import owned_parameters

    import test_hf

    cfg = test_hf._trainer_config(folder, f"{run_dir}-{dist.get_world_size()}", dp, schedule, m, **overrides)
    lora = dict(LORA, targets=list(lora_targets)) if lora_targets else dict(LORA)
    OmegaConf.update(cfg, "model.lora", lora, merge=True)  # a typed node: merged, as an override is
    trainer = build_run(cfg, torch.device("cpu"))
    dtype = getattr(torch, cfg.train.param_dtype)
    spec = build_spec(cfg.model)
    ref = test_hf.reference(kind, folder).to(dtype)
    ref = inject_adapter_in_model(spec.lora.peft_config(), ref)
    with torch.no_grad():  # the pipelined layers' adapters, every layer's
        for layer in spec.build_all(dtype=dtype):
            for name, p in layer.named_parameters():
                if p.requires_grad:
                    ref.get_parameter(name).copy_(p)
    _set_lora_b(ref.named_parameters())
    mine = [(name, p) for stage in trainer.parts.stages.values() for layer in stage.module for name, p in
            layer.named_parameters()]
    _set_lora_b([(n, p) for n, p in mine if isinstance(p, torch.Tensor)])
    trainable = [(p, ref.get_parameter(n)) for n, p in mine if p.requires_grad]
    frozen = [p for n, p in mine if not p.requires_grad]
    o = cfg.optim
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=o.lr, betas=(o.beta1, o.beta2),
                                weight_decay=o.weight_decay)
    batches = build_batches(cfg.data, cfg.model, chunks=dp * m)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0, "compared": len(trainable), "frozen": len(frozen),
             "frozen_grads": 0, "frozen_in_optimizer": 0,
             "adapters": sum(p.requires_grad for p in ref.parameters()),  # the whole model's adapter tensors
             "expert_adapters": sum(".experts." in n for n, p in mine if p.requires_grad)}
    optimized = {id(p) for p in trainer.parts.params}
    worst["frozen_in_optimizer"] = sum(id(p) in optimized for p in frozen)
    worst["sharded"] = sum(isinstance(p, DTensor) for p, _ in trainable)
    for step in range(steps):
        for group in trainer.loop.update.optimizer.param_groups + opt_ref.param_groups:
            group["lr"] = lr_at(step, o, cfg.train.max_steps)
        loss, _ = trainer.forward_backward(step)
        x, y = batches.train.get(step)
        loss_ref = cross_entropy(ref(x).logits, y)
        loss_ref.backward()
        worst["loss"] = max(worst["loss"], abs(loss - loss_ref.item()) / abs(loss_ref.item()))
        worst["grad"] = max([worst["grad"]] + [test_hf.rel(test_hf._full(a.grad), b.grad) for a, b in trainable])
        worst["frozen_grads"] += sum(p.grad is not None for p in frozen)
        trainer.loop.update.optimizer.step()
        trainer.loop.update.optimizer.zero_grad(set_to_none=True)
        opt_ref.step()
        opt_ref.zero_grad()
        worst["param"] = max([worst["param"]] + [test_hf.rel(test_hf._full(a.detach()), b.detach())
                                                 for a, b in trainable])
    state = {id(p) for p in owned_parameters(trainer.loop.update.optimizer)}
    worst["frozen_in_optimizer"] += sum(id(p) in state or id(local(p)) in state for p in frozen)
    worst["compile"] = None if trainer.parts.compiled is None else trainer.parts.compiled.summary()  # train.compile
    worst["report"] = [line for line in trainer.describe().splitlines() if line.startswith("model.lora")]
    if resume_dp:  # the checkpoint of this layout, resumed at dp x pp = world x 1: every rank all the adapters
        path = trainer.save_checkpoint(steps)
        cfg.parallel.dp, cfg.train.resume = dist.get_world_size(), path
        cfg.parallel.tp, cfg.parallel.sequence_parallel = 1, False
        cfg.train.run_dir = f"{cfg.train.run_dir}-resumed"
        again = build_run(cfg, torch.device("cpu"))
        worst["resumed_step"] = again.resume()
        back = [(p, ref.get_parameter(n)) for stage in again.parts.stages.values() for layer in stage.module
                for n, p in layer.named_parameters() if p.requires_grad]
        worst["resumed"] = max(test_hf.rel(test_hf._full(a.detach()), b.detach()) for a, b in back)
        worst["resumed_compared"] = len(back)
    return worst
