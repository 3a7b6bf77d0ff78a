"""A case run inside test_hf's 2-process gloo world (see mp_harness): ``data=chat`` through the
real Trainer with ``model=hf``, against Hugging Face's own model on the whole packed, masked batch.

The conversations are tokenised in the workers with the tiny tokenizer and chat template of
tests/chat_fixtures.py (written by rank 0 beside them), packed with document ids; Hugging Face is
given the positions restarting per conversation (its packed-sequence reading) and its mean cross
entropy ignores the masked prompts, as the unsplit model on the global batch would.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import chat_fixtures as fx


def trainer_on_chat_vs_hf(folder: str, kind: str, run_dir: str, dp: int = 1, schedule: str = "zb_h1", m: int = 2,
                          steps: int = 2, **overrides: Any) -> dict[str, Any]:
    """Train `steps` steps on data=chat pipelined and with Hugging Face's model on the global batch
    (same AdamW and lr schedule); worst relative differences of loss, gradients and parameters,
    and the trained share of the targets (prompts really masked)."""
    import transformers

    import test_hf
    from pipeflow.data import build_batches
    from pipeflow.models.gpt import document_positions
    from pipeflow.models.module_spec import cross_entropy
    from pipeflow.run.builder import build_run
    from pipeflow.run.trainer import lr_at

    chats = f"{run_dir}-chats"
    if dist.get_rank() == 0:
        os.makedirs(chats, exist_ok=True)
        fx.write_tokenizer(chats)
        fx.write_jsonl(os.path.join(chats, "chats.jsonl"), fx.CONVERSATIONS * 3)
    dist.barrier()
    cfg = test_hf._trainer_config(folder, run_dir, dp, schedule, m, data__name="chat",
                                  data__path=os.path.join(chats, "chats.jsonl"), data__tokenizer=chats,
                                  data__seq_len=16, data__pack_documents=True, data__overlong="truncate",
                                  data__val_fraction=0.0, data__batch_size=4, **overrides)
    trainer = build_run(cfg, torch.device("cpu"))
    ref = test_hf.reference(kind, folder).to(torch.float64)
    o = cfg.optim
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
    batches = build_batches(cfg.data, cfg.model)
    both = [(mine, ref.get_parameter(name)) for stage in trainer.parts.stages.values()
            for layer in stage.module for name, mine in layer.named_parameters()]
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0, "compared": len(both), "trained": 1.0}
    for step in range(steps):
        for group in trainer.loop.update.optimizer.param_groups + opt_ref.param_groups:
            group["lr"] = lr_at(step, o, cfg.train.max_steps)
        loss, _ = trainer.forward_backward(step)
        (x, doc), y = batches.train.get(step)
        worst["trained"] = min(worst["trained"], float((y != -100).float().mean()))
        loss_ref = cross_entropy(ref(x, position_ids=document_positions(doc), use_cache=False).logits, y)
        loss_ref.backward()
        worst["loss"] = max(worst["loss"], abs(loss - loss_ref.item()) / abs(loss_ref.item()))
        worst["grad"] = max([worst["grad"]] + [test_hf.rel(a.grad, b.grad) for a, b in both])
        trainer.loop.update.optimizer.step()
        trainer.loop.update.optimizer.zero_grad(set_to_none=True)
        opt_ref.step()
        opt_ref.zero_grad()
        worst["param"] = max([worst["param"]] + [test_hf.rel(a.detach(), b.detach()) for a, b in both])
    trainer.close()
    return worst
