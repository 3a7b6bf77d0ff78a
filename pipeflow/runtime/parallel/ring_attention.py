"""Ring attention over the context-parallel group (``parallel.cp``): each rank holds a slice of
every sequence and attends to the whole sequence by passing key/value blocks round the ring on
pipeflow's batched P2P transport.

**The split** (:func:`chunk_order`): a sequence of T tokens is cut into 2N chunks for N cp ranks;
rank i holds chunks i and 2N - 1 - i (Megatron's and torch's head-tail order), so under a causal
mask every rank attends to the same number of (query, key) pairs.  Positions stay global
(:func:`local_positions`): rotary embeddings, masks and document ids are those of the whole
sequence.

**The forward** (:class:`RingAttention`): at ring step s a rank holds the key/value block of rank
(i - s) mod N; it posts the exchange that brings the next block (send its block to i + 1, receive
from i - 1, one batched call) before it attends to the current one, so the transfer runs under
the compute.  Each (query chunk, key chunk) pair that the mask hides whole is skipped, one it
shows whole runs without a mask.  Partial results merge exactly by their log-sum-exp:
``out = sum_s exp(lse_s - lse) out_s`` with ``lse = logsumexp_s lse_s``.

**The backward** recomputes each block's probabilities from the final log-sum-exp (no block's
attention matrix is kept) while the key/value blocks go round the ring again (the next posted
before the current is computed); the gradients for a block follow it one step behind, each rank
adding its share before passing them on (that transfer runs under the next block's compute),
and after N steps each block's dK and dV arrive at the rank that holds it.  With grouped-query
attention the ring carries the few key/value heads, expanded to the query heads only for the
compute, and their gradients are summed back.

The per-block attention is written with matmuls and ``logsumexp`` (exact in float64, any mask:
causal, sliding window, packed documents); in float32 and lower on the CPU the blocks a mask
shows whole or as a causal square go through torch's fused flash kernel, which returns the
log-sum-exp beside the output (five times faster here; on GPUs SDPA's flash and efficient paths
return it too, for a later step).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

CAUSAL = "causal"
BACKWARD = "(backward)"  # the end of what a backward's pass round the ring says it carries
# False: each exchange is waited for as soon as it is posted, before the block it overlaps is
# computed (the baseline benchmarks/features/context_parallel.py measures the overlap against)
OVERLAP = True


def _posted(ring: RingComm, tensor: Tensor, what: str) -> Callable[[], Tensor]:
    """The wait for `tensor`'s pass round the ring (see :data:`OVERLAP`)."""
    arrive = ring.pass_on(tensor, what)
    if OVERLAP:
        return arrive
    arrived = arrive()
    return lambda: arrived


def chunk_order(ranks: int) -> list[tuple[int, int]]:
    """The two chunks (of 2 x `ranks`) each cp rank holds: rank i has chunks i and 2N - 1 - i."""
    return [(i, 2 * ranks - 1 - i) for i in range(ranks)]


def local_positions(length: int, rank: int, ranks: int, device: torch.device | None = None) -> Tensor:
    """The global positions (T / N,) of the tokens cp rank `rank` of `ranks` holds of a sequence
    of `length` tokens, in the order it holds them."""
    chunk = length // (2 * ranks)
    first, second = chunk_order(ranks)[rank]
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


def split_sequence(x: Tensor, rank: int, ranks: int, dim: int = 1) -> Tensor:
    """Cp rank `rank`'s two chunks of `x` along `dim` (the sequence), head-tail ordered."""
    chunks = x.chunk(2 * ranks, dim=dim)
    first, second = chunk_order(ranks)[rank]
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def split_batch(x: Any, y: Tensor, rank: int, ranks: int) -> tuple[Any, Tensor]:
    """Cp rank `rank`'s share of a batch's inputs `x` and targets `y` (rows (B, T)): its two chunks
    of each row; packed documents ``(tokens, document ids)`` keep the whole rows' document ids
    (positions and masks need them)."""
    tokens = (split_sequence(x[0], rank, ranks), *x[1:]) if isinstance(x, tuple) else split_sequence(x, rank, ranks)
    return tokens, split_sequence(y, rank, ranks)


def gather_sequence(parts: list[Tensor], dim: int = 1) -> Tensor:
    """The whole sequence from every cp rank's local part (``parts[i]``: rank i's), in order."""
    ranks = len(parts)
    chunks: list[Tensor | None] = [None] * (2 * ranks)
    for i, part in enumerate(parts):
        first, second = chunk_order(ranks)[i]
        chunks[first], chunks[second] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


class Masking:
    """Which (query, key) pairs attend, from global positions: causal, a sliding window of
    `window` tokens (a query sees itself and the window - 1 before it), packed documents
    (`doc`: (B, T) document ids of the whole sequences; a query sees only its document)."""

    def __init__(self, causal: bool = True, window: int | None = None, doc: Tensor | None = None) -> None:
        self.causal, self.window, self.doc = causal, window, doc

    def mask(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """(B or 1, 1, Tq, Tk) booleans: True where query q_pos[i] attends to key k_pos[j]."""
        seen = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool, device=q_pos.device)
        diff = q_pos[:, None] - k_pos[None, :]
        if self.causal:
            seen &= diff >= 0
        if self.window is not None:
            seen &= diff < self.window
        seen = seen[None, None]
        if self.doc is not None:
            seen = seen & (self.doc[:, q_pos][:, None, :, None] == self.doc[:, k_pos][:, None, None, :])
        return seen


def _expand(t: Tensor, heads: int) -> Tensor:
    """Key/value heads repeated to the query heads (grouped-query attention)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold(t: Tensor, kv_heads: int) -> Tensor:
    """A gradient over the query heads summed back onto the key/value heads."""
    b, h, n, d = t.shape
    return t if h == kv_heads else t.view(b, kv_heads, h // kv_heads, n, d).sum(2)


def _pieces(mask: Tensor, parts: int) -> list[tuple[slice, slice, Tensor | None]]:
    """The (query rows, key columns, mask or None: all seen) sub-blocks of a block's `mask` cut in
    `parts` x `parts` that any pair attends in."""
    tq, tk = mask.shape[-2] // parts, mask.shape[-1] // parts
    out = []
    for i in range(parts):
        for j in range(parts):
            rows, cols = slice(i * tq, (i + 1) * tq), slice(j * tk, (j + 1) * tk)
            sub = mask[..., rows, cols]
            if bool(sub.any()):
                out.append((rows, cols, None if bool(sub.all()) else sub))
    return out


def _kernel_causality(q: Tensor, mask: Tensor | None) -> bool | None:
    """Whether the fused CPU kernel computes this block (False: whole, True: causal), or None: the
    matmul path.  The kernel takes float32 and lower (float64 stays on the matmul path, exact to
    the last bit where the tests compare), no mask but the diagonal block's causal square, and
    returns the rows' log-sum-exp with it."""
    if q.device.type != "cpu" or q.dtype == torch.float64:
        return None
    if mask is None:
        return False
    square = mask.shape[-1] == mask.shape[-2] and mask.shape[0] == 1
    if square and torch.equal(mask[0, 0], torch.ones_like(mask[0, 0]).tril()):
        return True
    return None


def _scores(q: Tensor, k: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """q k^T scale, -inf where `mask` hides a pair (forward and backward alike)."""
    scores = (q @ k.transpose(-2, -1)) * scale
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """(out, lse) of q against one key/value block: softmax(q k^T scale, masked) v and the rows'
    log-sum-exp (-inf for a row the block hides whole, whose out is 0); through the fused kernel
    where it applies (:func:`_kernel_causality`)."""
    causal = _kernel_causality(q, mask)
    if causal is not None:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[:2]
        return out, lse.to(q.dtype)
    scores = _scores(q, k, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return probs @ v, lse


def _merge(out: Tensor, lse: Tensor, part: Tensor, part_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Two partial attentions of the same queries over disjoint keys, merged exactly."""
    new = torch.logaddexp(lse, part_lse)
    safe = torch.where(torch.isfinite(new), new, 0.0)
    keep, add = torch.exp(lse - safe), torch.exp(part_lse - safe)
    return out * keep[..., None] + part * add[..., None], new


class RingComm:
    """The ring of the cp group: send to the next rank, receive from the previous one, as one
    batched call on a :class:`~pipeflow.runtime.transport.P2PComm` of the cp group (its named
    errors and deadlines)."""

    def __init__(self, comm: Any) -> None:
        self.comm, self.rank, self.size = comm, comm.rank, comm.size

    def pass_on(self, tensor: Tensor, what: str) -> Callable[[], Tensor]:
        """Post `tensor` to the next rank and a receive of the previous rank's; returns the wait
        that gives what arrived."""
        buffer = torch.empty_like(tensor)
        works = self.comm.post([((self.rank + 1) % self.size, tensor)], [((self.rank - 1) % self.size, buffer)],
                               what)

        def arrived() -> Tensor:
            self.comm.wait(works, what)
            return buffer
        return arrived


@dataclass(frozen=True)
class RingPass:
    """One pass round the ring as a :class:`LoopbackRing` saw it: in the backward or not, the
    bytes each rank sends, and the compute between posting it and waiting for it (what a real
    ring's transfer can hide behind)."""

    backward: bool
    bytes: int
    hidden_s: float


class LoopbackRing:
    """A ring of `size` ranks in one process, as rank 0 of it: each pass hands the tensor back.
    A layer profiled with it computes the blocks rank 0 of a real ring computes (its own keys
    and values standing for the others', masked as theirs), so the profile's attention cost and
    saved tensors are a cp rank's; the exchanges cost nothing here, and each is logged
    (:attr:`passes`) for the planner to price on a link (`pipeflow.planning.costs.context`)."""

    def __init__(self, size: int) -> None:
        self.comm, self.rank, self.size = None, 0, size
        self.passes: list[RingPass] = []

    def pass_on(self, tensor: Tensor, what: str) -> Callable[[], Tensor]:
        """`tensor` itself; the wait logs the pass and the time since it was posted."""
        backward = what.endswith(BACKWARD)
        _settle(tensor)
        posted = time.perf_counter()

        def arrived() -> Tensor:
            _settle(tensor)
            self.passes.append(RingPass(backward, tensor.numel() * tensor.element_size(), time.perf_counter() - posted))
            return tensor
        return arrived


def _settle(tensor: Tensor) -> None:
    """On a GPU, wait for the queued kernels, so host clocks time the device's compute."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


class RingAttention(torch.autograd.Function):
    """Attention of this rank's queries over the whole sequence's keys and values, passed round
    the cp ring (see the module docstring).  Inputs (B, H, T/N, D) queries and (B, Hkv, T/N, D)
    keys and values of this rank's two chunks."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, ring: RingComm, positions: Callable[[int], Tensor],
                masking: Masking, scale: float) -> Tensor:
        n, rank = ring.size, ring.rank
        mine = positions(rank)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        kv = torch.stack([k, v])
        for step in range(n):
            source = (rank - step) % n
            arrive = _posted(ring, kv, f"ring attention key/value block of cp rank {source}") if step < n - 1 else None
            keys, values = _expand(kv[0], q.shape[1]), _expand(kv[1], q.shape[1])
            for rows, cols, mask in _pieces(masking.mask(mine, positions(source)), 2):
                part, part_lse = _attend(q[..., rows, :], keys[..., cols, :], values[..., cols, :], mask, scale)
                out[..., rows, :], lse[..., rows] = _merge(out[..., rows, :], lse[..., rows], part, part_lse)
            if arrive is not None:
                kv = arrive()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.positions, ctx.masking, ctx.scale = ring, positions, masking, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring, positions, masking, scale = ctx.ring, ctx.positions, ctx.masking, ctx.scale
        n, rank, heads = ring.size, ring.rank, q.shape[1]
        mine = positions(rank)
        delta = (grad_out * out).sum(-1)  # (B, H, Tq): rowsum(dO * O)
        safe_lse = torch.where(torch.isfinite(lse), lse, 0.0)
        dq = torch.zeros_like(q)
        kv, gathered = torch.stack([k, v]), None  # gathered: the wait for the gradients of the block held now
        for step in range(n):
            source = (rank - step) % n
            arrive = (_posted(ring, kv, f"ring attention key/value block of cp rank {source} {BACKWARD}")
                      if step < n - 1 else None)
            keys, values = _expand(kv[0], heads), _expand(kv[1], heads)
            dk, dv = torch.zeros_like(keys), torch.zeros_like(values)
            for rows, cols, mask in _pieces(masking.mask(mine, positions(source)), 2):
                qs, ks, vs, go = q[..., rows, :], keys[..., cols, :], values[..., cols, :], grad_out[..., rows, :]
                probs = torch.exp(_scores(qs, ks, mask, scale) - safe_lse[..., rows, None])
                dv[..., cols, :] += probs.transpose(-2, -1) @ go
                dscores = probs * (go @ vs.transpose(-2, -1) - delta[..., rows, None]) * scale
                dq[..., rows, :] += dscores @ ks
                dk[..., cols, :] += dscores.transpose(-2, -1) @ qs
            grads = torch.stack([_fold(dk, k.shape[1]), _fold(dv, v.shape[1])])
            if gathered is not None:  # what the ranks before this one found for the same block
                grads = grads + gathered()
            # on to the next rank, which holds this block next step; after the last step each
            # block's gradients, every rank's share summed, arrive at the rank that holds it
            what = f"ring attention gradients of cp rank {source}'s block {BACKWARD}"
            gathered = _posted(ring, grads, what) if n > 1 else (lambda g=grads: g)
            if arrive is not None:
                kv = arrive()
        travel = gathered()
        return dq, travel[0], travel[1], None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, ring: RingComm, length: int, masking: Masking | None = None,
                   scale: float | None = None) -> Tensor:
    """Attention of this cp rank's queries (B, H, T/N, D) over the whole sequence of `length`
    tokens, whose keys and values (B, Hkv, T/N, D) each cp rank holds a head-tail slice of
    (:func:`split_sequence`); returns this rank's output (B, H, T/N, D).

    Args:
        q, k, v: this rank's queries, keys and values (its two chunks, head-tail ordered).
        ring: the cp group's ring (:class:`RingComm`); one rank: plain attention.
        length: the whole sequence's length T (2 x cp divides it).
        masking: which pairs attend (default: causal).
        scale: the scores' scale (default 1 / sqrt(D)).
    """
    masking = masking if masking is not None else Masking()
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])

    def positions(rank: int) -> Tensor:
        return local_positions(length, rank, ring.size, q.device)

    return RingAttention.apply(q, k, v, ring, positions, masking, scale)


class ContextParallel:
    """What a model's layers are given under ``parallel.cp`` (:func:`attach`): the global positions
    of this rank's tokens and attention over the whole sequence round the cp ring.  Models call it
    through the attribute ``context_parallel`` (None without cp), so they import nothing of the
    runtime: a layer holding that attribute takes context parallelism (the documented hook).

    Args:
        ring: the cp group's ring.
    """

    def __init__(self, ring: RingComm) -> None:
        self.ring, self.rank, self.size = ring, ring.rank, ring.size

    def positions(self, local_length: int, device: torch.device | None = None) -> Tensor:
        """The global positions of this rank's `local_length` tokens (its head and tail chunks)."""
        return local_positions(local_length * self.size, self.rank, self.size, device)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, window: int | None = None, causal: bool = True,
               scale: float | None = None, documents: Tensor | None = None) -> Tensor:
        """Attention of this rank's q (B, H, T/N, D) over the whole sequence's k, v (B, Hkv, T/N, D
        here each), round the ring (`documents`: (B, T) the whole rows' document numbers, packed
        documents attending within themselves); in a stage's shape trial (only the shape matters,
        and the other cp ranks are not trying) zeros."""
        from pipeflow.models.aux_loss import in_shape_trial

        if in_shape_trial():
            return torch.zeros_like(q)
        return ring_attention(q, k, v, self.ring, q.shape[2] * self.size, Masking(causal, window, documents), scale)


HOOK = "context_parallel"  # the attribute of a module that takes context parallelism


def attach(modules: Any, context: ContextParallel) -> int:
    """Give `context` to every module under `modules` (an iterable of modules) that has the
    :data:`HOOK` attribute; returns how many took it."""
    taken = 0
    for root in modules:
        for module in root.modules():
            if hasattr(module, HOOK):
                setattr(module, HOOK, context)
                taken += 1
    return taken
