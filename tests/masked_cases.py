"""Cases run inside test_scale's gloo group (see mp_harness): the Trainer on masked targets.

Targets masked with -100 (cross entropy's ignore_index), as supervised fine-tuning masks its
prompts: a seeded share of every batch's positions and every target of one micro-batch of the
global batch.  The pipelined loss, every gradient and the held-out loss must equal the unsplit
model's on the whole masked batch (the mean over the targets the loss counts).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeflow.errors import AllTargetsMaskedError
from pipeflow.models.spec import run_layers
from pipeflow.run.builder import build_run
from pipeflow.run.trainer import lr_at
from scale_cases import Reference, _shared_dir, make_config, pairs, rel_diff

MASKED_SHARE = 0.4  # of each batch's targets, drawn per step


class MaskedTargets:
    """`source`'s batches with targets masked: a seeded `MASKED_SHARE` of them, every target of
    micro-batch `empty` of the global batch's `chunks`, and every target of batch `all_masked`."""

    def __init__(self, source: Any, chunks: int, empty: int = 1, all_masked: int | None = None) -> None:
        self.source, self.chunks, self.empty, self.all_masked = source, chunks, empty, all_masked

    def get(self, step: int) -> tuple[Any, Any]:
        """Batch `step`, its targets masked (a copy; the source's stay as they are)."""
        x, y = self.source.get(step)
        gen = torch.Generator().manual_seed(7919 + step)

        def masked(t: torch.Tensor) -> torch.Tensor:
            return t.masked_fill(torch.rand(t.shape, generator=gen) < MASKED_SHARE, -100)

        if isinstance(y, list):
            y = [masked(t) for t in y]
            y[self.empty] = torch.full_like(y[self.empty], -100)
        else:
            y = masked(y)
            y.tensor_split(self.chunks)[self.empty].fill_(-100)  # a view: fills y's rows
        if step == self.all_masked:
            y = [torch.full_like(t, -100) for t in y] if isinstance(y, list) else torch.full_like(y, -100)
        return x, y


def masked_mean(reference: Reference, x: Any, y: Any) -> torch.Tensor:
    """The unsplit model's loss on a whole masked batch: the summed cross entropy of the targets
    it counts over their number (micro-batches of different lengths summed alike)."""
    xs, ys = (x, y) if isinstance(x, list) else ([x], [y])
    total = sum(int((t != -100).sum()) for t in ys)
    summed = sum(F.cross_entropy(run_layers(reference.layers, a).flatten(0, -2), t.flatten(), reduction="sum")
                 for a, t in zip(xs, ys))
    return summed / total


def masked_equivalence(dp: int, schedule: str = "1f1b", m: int = 2, steps: int = 3, chat: bool = False,
                       **overrides: Any) -> dict[str, Any]:
    """Train `steps` steps on masked targets, dp x pp against the unsplit model, then evaluate;
    worst relative differences of loss, gradients, parameters and the held-out loss.  With
    `chat`, the data is ``data=chat`` (:func:`chat_folder`'s conversations, packed with their
    document ids, prompts masked) instead of Markov tokens masked by :class:`MaskedTargets`."""
    if chat:
        overrides = {"data__name": "chat", "data__path": chat_folder(), "data__pack_documents": True,
                     "data__overlong": "truncate", "data__val_fraction": 0.25, **overrides}
    cfg = make_config(dp, schedule, m, train__eval_batches=2, **overrides)
    trainer, reference = build_run(cfg, torch.device("cpu")), Reference(cfg)
    train, val = reference.batches.train, reference.batches.val
    if not chat:
        chunks = dp * m
        trainer.plan.batches.train = MaskedTargets(trainer.plan.batches.train, chunks)
        trainer.plan.batches.val = MaskedTargets(trainer.plan.batches.val, chunks, empty=0)
        train, val = MaskedTargets(train, chunks), MaskedTargets(val, chunks, empty=0)
    both = pairs(trainer, reference)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0, "params_compared": len(both)}
    for step in range(steps):
        for group in trainer.loop.update.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.optim, cfg.train.max_steps)
        loss, _ = trainer.forward_backward(step)
        ref_loss = masked_mean(reference, *train.get(step))
        ref_loss.backward()
        worst["loss"] = max(worst["loss"], abs(loss - ref_loss.item()) / abs(ref_loss.item()))
        worst["grad"] = max([worst["grad"]] + [rel_diff(a.grad, b.grad) for a, b in both])
        trainer.loop.update.optimizer.step()
        trainer.loop.update.optimizer.zero_grad(set_to_none=True)
        reference.step(step)
        worst["param"] = max([worst["param"]] + [rel_diff(a.detach(), b.detach()) for a, b in both])
    with torch.no_grad():
        batches = [val.get(k) for k in range(cfg.train.eval_batches)]
        counts = [sum(int((t != -100).sum()) for t in (y if isinstance(y, list) else [y])) for _, y in batches]
        expected = sum(c * float(masked_mean(reference, x, y)) for c, (x, y) in zip(counts, batches)) / sum(counts)
    worst["val"] = abs(trainer.evaluate() - expected) / expected
    trainer.close()
    return worst


def chat_folder(count: int = 40, vocab: int = 32) -> str:
    """A ``prepare --chat`` folder of `count` seeded conversations of 3..14 tokens (ids below
    `vocab`), the second half of each trained as an answer is: written by rank 0 with numpy alone
    (no tokenizer: tests/test_chat.py tests tokenising), its path on every rank."""
    from pipeflow.data.chat_rows import Conversations, save_conversations

    gen = torch.Generator().manual_seed(11)
    lengths = torch.randint(3, 15, (count,), generator=gen)
    tokens = torch.randint(1, vocab, (int(lengths.sum()),), generator=gen)
    trained = torch.cat([torch.arange(int(n)) >= int(n) // 2 for n in lengths])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    folder = _shared_dir("pipeflow-chat-")
    if dist.get_rank() == 0:
        save_conversations(Conversations(tokens.numpy(), trained.numpy(), starts.numpy()), Path(folder))
    dist.barrier()
    return folder


def all_masked_step_is_an_error(dp: int = 2, schedule: str = "1f1b", m: int = 2) -> str:
    """A training batch whose every target is masked: AllTargetsMaskedError on every rank that holds
    the batch (with pp = 2, every rank), before any transfer."""
    trainer = build_run(make_config(dp, schedule, m), torch.device("cpu"))
    trainer.plan.batches.train = MaskedTargets(trainer.plan.batches.train, dp * m, all_masked=1)
    trainer.train_step(0)
    try:
        trainer.train_step(1)
    except AllTargetsMaskedError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        trainer.close()
    return "no error"
