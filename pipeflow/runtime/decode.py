"""Generation on the pipeline: micro-batches of prompts flow through the stages, one new token per
pass, each stage keeping the KV cache of its own layers.

Each rank runs one stage (rank s: stage s).  A micro-batch's first pass (prefill) carries its
left-padded prompts; each later pass carries the one token its last pass made.  Stage 0 sends
every pass's hidden states on with a small header ``[micro-batch, step, *shape]``; each stage
runs its layers and passes them on; the last stage turns the last position's logits into the next
token ids (greedy or sampled) and sends them back to stage 0, which feeds them in as the
micro-batch's next pass.  Several micro-batches are in flight at once (``in_flight``): while the
last stage samples micro-batch g, stage 0 already runs g + 1, so the stages overlap; with
``in_flight=1`` each micro-batch is finished before the next starts.  A header with micro-batch
-1 ends the loop on every stage.

A row stops at any end-of-sequence id or at its micro-batch's step limit (``max_new_tokens``,
cut to the model's context); a stopped row is fed ``pad_id`` until its micro-batch stops (as
``transformers``' ``generate`` does), which changes nothing for the other rows.  Every stage
knows each micro-batch's prompts, so positions and the padding mask of a pass are made locally
from (micro-batch, step); only hidden states and token ids cross ranks.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from pipeflow.errors import ConfigError
from pipeflow.runtime.transport import P2PComm

HEADER = 5  # micro-batch, step, then the hidden states' shape (B, q, C)
_END = -1


class StageDecoder(Protocol):
    """One stage's layers run with a cache (:mod:`pipeflow.models.hf_decode`, ``gpt_decode``)."""

    context: int  # the positions the model has (the longest prompt plus completion)

    def new_cache(self) -> Any: ...

    def forward(self, x: Tensor, positions: Tensor, pad_mask: Tensor, cache: Any) -> Tensor: ...


@dataclass
class PromptBatch:
    """One micro-batch of prompts, left-padded: ``ids`` (B, L) long, ``mask`` (B, L) bool (True: a
    real token), and ``steps``, the most tokens it may make."""

    ids: Tensor
    mask: Tensor
    steps: int

    def positions(self, step: int) -> Tensor:
        """The positions of the tokens of pass `step` (B, q): real tokens counted from 0."""
        if step == 0:
            return (self.mask.long().cumsum(-1) - 1).masked_fill(~self.mask, 0)
        return self.mask.long().sum(-1, keepdim=True) - 1 + step

    def pad_mask(self, step: int) -> Tensor:
        """Which of the cached and new tokens are real at pass `step` (B, L + step)."""
        return torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], step)], 1)


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int, steps: int, context: int,
                device: torch.device | str = "cpu") -> PromptBatch:
    """`prompts` (token id lists) as one left-padded micro-batch that makes at most `steps` tokens,
    fewer where the longest prompt and `steps` would pass `context` (the model's positions).

    Raises:
        ConfigError: a prompt that is empty or already fills the context.
    """
    longest = max(len(p) for p in prompts)
    if min(len(p) for p in prompts) == 0:
        raise ConfigError("an empty prompt (no tokens) cannot be continued: remove the empty line from generate.prompts")
    if longest >= context:
        raise ConfigError(f"a prompt of {longest} tokens fills the model's context of {context} positions "
                          f"(max_position_embeddings): shorten it")
    ids = torch.tensor([[pad_id] * (longest - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
    mask = torch.tensor([[False] * (longest - len(p)) + [True] * len(p) for p in prompts], device=device)
    return PromptBatch(ids, mask, min(steps, context - longest))


@dataclass
class Sampler:
    """Next-token choice on the last stage: greedy at ``temperature`` 0, else softmax sampling of
    logits / temperature within the smallest set of tokens whose probability reaches ``top_p``,
    drawn from one generator seeded with ``seed``."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.generator = torch.Generator().manual_seed(self.seed)

    def __call__(self, logits: Tensor) -> Tensor:
        """Token ids (B,) long from the last position's logits (B, V)."""
        if self.temperature <= 0:
            return logits.argmax(-1)
        scores = logits.float() / self.temperature
        if self.top_p < 1.0:  # as transformers' TopPLogitsWarper: drop the tail below 1 - top_p, keep >= 1
            ordered, order = scores.sort(-1)
            tail = ordered.softmax(-1).cumsum(-1) <= 1 - self.top_p
            tail[:, -1] = False
            scores = scores.masked_fill(tail.scatter(1, order, tail), float("-inf"))
        probs = scores.softmax(-1).cpu()
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(1).to(logits.device)


@dataclass
class _Progress:
    """Stage 0's view of one micro-batch: the tokens made per row, which rows stopped, the next input."""

    made: list[list[int]]
    stopped: Tensor
    step: int = 0
    next_ids: Tensor | None = None


def _absorb(progress: _Progress, tokens: Tensor, batch: PromptBatch, eos_ids: set[int], pad_id: int) -> bool:
    """Take one pass's tokens into `progress`; returns whether the micro-batch is done."""
    for row, token in enumerate(tokens.tolist()):
        if not progress.stopped[row]:
            progress.made[row].append(token)
    # a row that had stopped is fed padding; one that stops now is fed its end-of-sequence id
    progress.next_ids = tokens.masked_fill(progress.stopped.to(tokens.device), pad_id)[:, None]
    progress.stopped |= torch.tensor([t in eos_ids for t in tokens.tolist()], dtype=torch.bool)
    progress.step += 1
    return bool(progress.stopped.all()) or progress.step >= batch.steps


def generate(decoder: StageDecoder, batches: Sequence[PromptBatch], sampler: Sampler, eos_ids: Sequence[int],
             pad_id: int, comm: P2PComm | None = None, dtype: torch.dtype = torch.float32, in_flight: int = 0,
             on_tokens: Callable[[int, list[list[int]]], None] | None = None) -> list[list[list[int]]] | None:
    """Generate from every micro-batch on the pipeline (collective over `comm`'s ranks, each one stage).

    Args:
        decoder: this rank's stage (rank s runs stage s of ``comm.size``).
        batches: the micro-batches, the same on every rank.
        sampler: used on the last stage.
        eos_ids: the ids that stop a row (kept as its last token).
        pad_id: fed to rows that stopped.
        comm: the pipeline's transport; None: one stage holds every layer.
        dtype: the hidden states' dtype between stages.
        in_flight: micro-batches in flight at once (0: all); 1 runs them one after another.
        on_tokens: stage 0 only, called ``on_tokens(micro-batch, tokens per row so far)`` after each pass.

    Returns:
        On stage 0, the tokens made for each micro-batch and row (each ending at its first
        end-of-sequence id, which is kept); None on the other stages.
    """
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    window = in_flight if in_flight > 0 else max(1, len(batches))
    if rank > 0:
        _follow(decoder, batches, sampler, comm, dtype, window)  # type: ignore[arg-type]
        return None
    eos = set(int(e) for e in eos_ids)
    progress = [_Progress([[] for _ in range(b.ids.shape[0])], torch.zeros(b.ids.shape[0], dtype=torch.bool))
                for b in batches]
    caches: list[Any] = [decoder.new_cache() for _ in batches]
    sends: deque[tuple[list[Any], list[Tensor]]] = deque()
    for first in range(0, len(batches), window):
        ready, pending = deque(range(first, min(first + window, len(batches)))), deque()
        ready = deque(g for g in ready if batches[g].steps > 0)
        while ready or pending:
            if ready:  # run every micro-batch that has its input before waiting for tokens
                g = ready.popleft()
                batch, state = batches[g], progress[g]
                x = batch.ids if state.step == 0 else state.next_ids.to(batch.ids.device)  # type: ignore[union-attr]
                out = decoder.forward(x, batch.positions(state.step), batch.pad_mask(state.step), caches[g])
                if size == 1:
                    tokens = sampler(out)
                else:
                    header = torch.tensor([g, state.step, *out.shape], dtype=torch.long).to(comm.device)  # type: ignore[union-attr]
                    _post(comm, sends, 1, [header, out.contiguous()], f"send micro-batch {g} pass {state.step} to stage 1")
                    _drain(comm, sends, keep=2 * window)
                    pending.append(g)
                    continue
            else:
                g = pending.popleft()
                tokens = torch.empty(batches[g].ids.shape[0], dtype=torch.long, device=comm.device)  # type: ignore[union-attr]
                comm.exchange([], [(size - 1, tokens)], what=f"receive micro-batch {g}'s next tokens")  # type: ignore[union-attr]
            done = _absorb(progress[g], tokens.cpu(), batches[g], eos, pad_id)
            if on_tokens is not None:
                on_tokens(g, progress[g].made)
            if done:
                caches[g] = None  # its keys and values are no longer needed
            else:
                ready.append(g)
    if size > 1:
        end = torch.tensor([_END] * HEADER, dtype=torch.long, device=comm.device)  # type: ignore[union-attr]
        _post(comm, sends, 1, [end], "send the end of generation to stage 1")  # type: ignore[arg-type]
        _drain(comm, sends, keep=0)  # type: ignore[arg-type]
    return [p.made for p in progress]


def _post(comm: P2PComm, sends: deque[tuple[list[Any], list[Tensor]]], peer: int, tensors: list[Tensor],
          what: str) -> None:
    """Post `tensors` to `peer` without waiting; the works are kept with the tensors (a buffer must
    outlive its send)."""
    sends.append((comm.post([(peer, t) for t in tensors], [], what=what), tensors))


def _drain(comm: P2PComm, sends: deque[tuple[list[Any], list[Tensor]]], keep: int) -> None:
    """Wait for the oldest posted sends until at most `keep` remain in flight (gloo: every Work waited)."""
    while len(sends) > keep:
        comm.wait(sends.popleft()[0], what="send on")


def _follow(decoder: StageDecoder, batches: Sequence[PromptBatch], sampler: Sampler, comm: P2PComm,
            dtype: torch.dtype, window: int) -> None:
    """A stage after the first: run each pass that arrives, pass it on (or, last, send the tokens
    back to stage 0) until the end header.  Micro-batches start in windows of `window`: when one
    starts, the caches of the windows before (all done) are dropped."""
    last = comm.rank == comm.size - 1
    caches: dict[int, Any] = {}
    sends: deque[tuple[list[Any], list[Tensor]]] = deque()
    header = torch.empty(HEADER, dtype=torch.long, device=comm.device)
    arriving = comm.post([], [(comm.rank - 1, header)], what="receive the next pass's header")
    while True:
        comm.wait(arriving, what="receive the next pass's header")
        g, step, *shape = header.tolist()
        if g == _END:
            if not last:
                _post(comm, sends, comm.rank + 1, [header], "pass the end of generation on")
            break
        hidden = torch.empty(shape, dtype=dtype, device=comm.device)
        comm.exchange([], [(comm.rank - 1, hidden)], what=f"receive micro-batch {g} pass {step}")
        header = torch.empty(HEADER, dtype=torch.long, device=comm.device)  # the next one's, on its way while this runs
        arriving = comm.post([], [(comm.rank - 1, header)], what="receive the next pass's header")
        batch = batches[g]
        if step == 0:
            for done in [h for h in caches if h < g - g % window]:
                del caches[done]
            caches[g] = decoder.new_cache()
        out = decoder.forward(hidden, batch.positions(step).to(hidden.device), batch.pad_mask(step).to(hidden.device),
                              caches[g])
        if last:
            _post(comm, sends, 0, [sampler(out).to(torch.long).contiguous()], f"send micro-batch {g}'s next tokens")
        else:
            sent = torch.tensor([g, step, *out.shape], dtype=torch.long, device=comm.device)
            _post(comm, sends, comm.rank + 1, [sent, out.contiguous()], f"send micro-batch {g} pass {step} on")
        _drain(comm, sends, keep=8)
    _drain(comm, sends, keep=0)
