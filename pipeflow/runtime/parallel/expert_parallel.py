"""Expert parallelism: a stage's experts split over the ranks of an ep group, tokens sent to their
experts' ranks and back with ``all_to_all`` (gloo and NCCL have it).

Index letters: r = a rank of the ep group (``ep`` of them), j = one of a rank's L = E / ep experts
(global index r L + j).  A MoE layer (``pipeflow.models.moe.MoE.split_experts``) keeps its own
experts and hands the exchange its tokens sorted by global expert with the count per expert;
:class:`AllToAllExchange` then

1. swaps the counts (``all_to_all``, a host read): how many tokens each rank sends each local expert;
2. sends every rank its experts' tokens (``all_to_all`` with those splits), regroups what arrived
   (rank-major) by local expert, runs each local expert once on its tokens from every rank;
3. sends the outputs back the way they came; the layer applies its gates where the tokens live.

With a recorder (:class:`~pipeflow.runtime.events.EventRecorder`) that is on, every exchange is
recorded as an ``a2a`` event (``counts``, ``dispatch``, ``combine``, and in backward ``combine
grad``, ``dispatch grad``) between two of its marks: the host clock on the CPU, where gloo's
all_to_all returns when done, CUDA events on the current stream on a GPU (no host wait added).

Both exchanges are differentiable (:class:`AllToAll`: backward is the reverse exchange), so the
expert weights' gradients gather every rank's tokens; summing them over the ranks holding the same
expert (``ep < dp``) and averaging over dp is the gradient reducer's business.  Every rank of the
group runs the same pipeline program, so the exchanges (forward, backward, recomputation, a split
backward's W) meet in the same order on every rank.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipeflow.errors import ConfigError
from pipeflow.models.aux_loss import in_shape_trial
from pipeflow.models.hf_experts import hf_experts_modules, split_hf_experts
from pipeflow.models.moe import MoE
from pipeflow.runtime import overlap
from pipeflow.runtime.events import A2A, EventRecorder


class AllToAll(torch.autograd.Function):
    """``AllToAll.apply(x, out_splits, in_splits, group, recorder, name)``: rows ``in_splits[r]``
    of x go to rank r, ``out_splits[r]`` rows come from rank r; backward sends the gradients back
    the same way (recorded as ``<name> grad``)."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup,  # noqa: D102
                recorder: EventRecorder | None = None, name: str = "") -> Tensor:
        ctx.splits, ctx.group, ctx.recorder, ctx.name = (out_splits, in_splits), group, recorder, name
        return _exchange(x, out_splits, in_splits, group, recorder, name)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # noqa: D102
        out_splits, in_splits = ctx.splits
        back = _exchange(grad, in_splits, out_splits, ctx.group, ctx.recorder, f"{ctx.name} grad")
        return back, None, None, None, None, None


def _exchange_now(x: Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group: dist.ProcessGroup,
                  recorder: EventRecorder | None = None, name: str = "") -> Tensor:
    """One all_to_all of x's rows (equal shares where the splits are None), recorded as `name`
    when `recorder` is on."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]) if out_splits is not None else x.shape)
    on = recorder is not None and recorder.on
    start = recorder.mark() if on else None
    # started, then waited for: inside an overlapped pair the other action computes meanwhile
    overlap.wait(dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group, async_op=True))
    if on:
        recorder.record(A2A, name, start, recorder.mark())
    return out


# what the exchanges call: made torch.compiler.disable'd by split_experts (a compiled layer runs it as
# it is: no guard on the recorder, no traced clock); the decorator imports Dynamo, about a second of
# every process, so only runs that split experts pay it
_exchange = _exchange_now


class AllToAllExchange:
    """Runs tokens through experts spread over the `ranks` ranks of `group` (this rank holds the
    experts ``rank * L .. rank * L + L - 1``)."""

    def __init__(self, group: dist.ProcessGroup, ranks: int, recorder: EventRecorder | None = None) -> None:
        self.group, self.ranks, self.recorder = group, ranks, recorder

    def __call__(self, tokens: Tensor, sizes: list[int], experts: list[nn.Module]) -> Tensor:
        """`tokens` (n, C) sorted by global expert, ``sizes[e]`` of them for expert e -> the
        experts' outputs (n, C) in the same order."""
        if in_shape_trial():  # only the shape matters, and the other ranks may not be trying
            return torch.zeros_like(tokens)
        ep, L = self.ranks, len(experts)
        sent = torch.tensor(sizes, dtype=torch.long, device=tokens.device)  # (E,) = ep chunks of L
        got = _exchange(sent, None, None, self.group, self.recorder, "counts")
        counts = got.view(ep, L).tolist()  # counts[r][j]: rank r's tokens for my expert j
        in_splits = [sum(sizes[r * L:(r + 1) * L]) for r in range(ep)]
        out_splits = [sum(row) for row in counts]
        pieces = AllToAll.apply(tokens, out_splits, in_splits, self.group, self.recorder, "dispatch")
        pieces = pieces.split([c for row in counts for c in row])
        outs = [expert(torch.cat([pieces[r * L + j] for r in range(ep)])) for j, expert in enumerate(experts)]
        parts = [out.split([counts[r][j] for r in range(ep)]) for j, out in enumerate(outs)]
        back = torch.cat([parts[j][r] for r in range(ep) for j in range(L)])  # rank-major again
        return AllToAll.apply(back, in_splits, out_splits, self.group, self.recorder, "combine")


def split_experts(layers: Iterable[nn.Module], group: dist.ProcessGroup, ep: int,
                  recorder: EventRecorder | None = None) -> int:
    """Keep only this rank's experts in every MoE layer of `layers` (``parallel.ep``: the `ep` ranks
    of `group`), their tokens exchanged with ``all_to_all`` (timed into `recorder` while it is on);
    returns how many layers were split.

    Raises:
        ConfigError: ep does not divide a layer's experts.
    """
    global _exchange
    if _exchange is _exchange_now:
        _exchange = torch.compiler.disable(_exchange_now)
    rank, exchange, split = dist.get_rank(group), AllToAllExchange(group, ep, recorder), 0
    for layer in layers:
        for module in layer.modules():
            if isinstance(module, MoE):
                module.split_experts(rank, ep, exchange)
                overlap.mark_communicating(module)  # its exchanges are an overlapped pair's hand-over points
                split += 1
        for path, module in hf_experts_modules(layer):  # a Hugging Face family's fused experts
            split_hf_experts(path, module, rank, ep, group, exchange)
            overlap.mark_communicating(module)
            split += 1
    return split


def expert_parallel_ranks(stages: Iterable[Any]) -> list[int] | None:
    """The global ranks of the ep group whose experts `stages`' MoE layers exchange tokens with
    (None: no layer's experts are split); a stage is a module or holds one (``.module``)."""
    for stage in stages:
        for module in getattr(stage, "module", stage).modules():
            exchange = getattr(module, "_exchange", None)  # pipeflow's MoE, or a Hugging Face experts module
            if isinstance(exchange, AllToAllExchange):
                return list(dist.get_process_group_ranks(exchange.group))
    return None


def expert_rank(dp_groups: list[list[int]], ep: int) -> int:
    """This rank's rank in the ep group :func:`expert_groups` makes for it (known before any group
    is made: the layers are built holding only its experts)."""
    me = dist.get_rank()
    ranks = next(ranks for ranks in dp_groups if me in ranks)
    first = ranks.index(me) // ep * ep
    return sorted(ranks[first:first + ep]).index(me)  # a process group numbers its ranks in order


def expert_groups(dp_groups: list[list[int]], ep: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """This rank's ep group (ep consecutive ranks of its dp group: they split the experts) and the
    group of the dp / ep ranks that hold the same experts (None when ep = dp), made from every
    stage's dp group (`dp_groups`, each in dp order) by every rank alike (collective).

    An expert's gradient gathers its ep group's tokens (all_to_all's backward); summed over the
    ranks holding the same expert it gathers every replica's, and is averaged over dp."""
    me, split, same = dist.get_rank(), None, None  # (ep = dp: a group of the dp group's ranks of its own)
    for ranks in dp_groups:
        for c in range(0, len(ranks), ep):
            group = dist.new_group(ranks[c:c + ep])
            split = group if me in ranks[c:c + ep] else split
        if ep < len(ranks):
            for j in range(ep):
                group = dist.new_group(ranks[j::ep])
                same = group if me in ranks[j::ep] else same
    return split, same


def is_expert_parameter(name: str) -> bool:
    """Whether a layer's parameter `name` belongs to a routed expert (split by ep, not replicated)."""
    return ".experts." in f".{name}"


def check_expert_parallel(ep: int, dp: int, tp: int, shard: str, experts: int | None) -> None:
    """Raise ConfigError for a ``parallel.ep`` this runtime cannot run, naming what to change: ep
    must divide dp (the ep ranks are consecutive dp ranks of a stage; with ep < dp each expert is
    held by dp / ep of them) and the experts, and runs without tensor parallelism and without
    ``parallel.shard`` (experts are not sharded further).  `experts` None: not known before the
    model is built (``model=hf``: :func:`split_experts` checks them)."""
    if ep == 1:
        return
    problems = (
        (experts == 0, "the model has no experts (model.moe.experts=0): use parallel.ep=1"),
        (dp % ep != 0, f"the ep ranks are a stage's dp ranks: ep must divide parallel.dp={dp}"),
        (experts is not None and experts % ep != 0, f"parallel.ep={ep} does not divide model.moe.experts={experts}"),
        (tp > 1, f"experts are not split by tensor parallelism: parallel.tp={tp} with parallel.ep={ep}; use tp=1"),
        (shard != "none", f"parallel.shard={shard} with parallel.ep={ep}: experts are not sharded over the ranks "
                          f"holding the same expert yet; use parallel.shard=none"),
    )
    for bad, message in problems:
        if bad:
            raise ConfigError(f"parallel.ep={ep}: {message}")


def expert_parameters(stages: Mapping[int, Any]) -> list[nn.Parameter]:
    """The routed experts' parameters of this rank's stages (``.experts.`` in their names): split
    over the ep ranks, not replicated, so neither all-reduced over dp nor counted 1/dp in a norm."""
    return [p for stage in stages.values() for name, p in stage.module.named_parameters()
            if is_expert_parameter(name) and p.requires_grad]  # frozen experts (LoRA) have no gradient to reduce
