"""A mixture-of-experts feed-forward for the GPT: a router sends each token to top_k of `experts`
expert MLPs and sums their outputs weighted by its gates (plus shared experts every token sees).

Shapes: N = tokens of the micro-batch (B x T), C = n_embd, E = routed experts, k = top_k,
H = expert_hidden.  The dispatch is local (a model never knows it is distributed): the tokens are
sorted by expert, each expert runs on its own rows, the outputs are added back in place.

Balancing (``balance``): ``aux_loss`` routes by softmax top-k and adds Switch/Megatron's
load-balancing loss ``coef * E * sum_e f_e * P_e`` per layer and micro-batch (f_e: the share of
the micro-batch's k x N assignments expert e got, P_e: its mean router probability); ``bias`` is
DeepSeek-V3's loss-free balancing: sigmoid scores, experts chosen by score + a per-expert bias
that the step's token counts (summed over micro-batches and data-parallel ranks, see
``pipeflow.runtime.parallel.routing``) move by ``bias_update_rate`` towards the mean.  The auxiliary loss
(and the optional router z-loss) is attached to the layer's output for backward
(:mod:`pipeflow.models.aux_loss`), weighted by the micro-batch's loss weight.

Capacity: None is dropless; with ``capacity_factor`` each expert takes at most
``ceil(factor * N * k / E)`` of the micro-batch's assignments, the highest-scored first; the rest
are dropped (their gate's share of the output is zero, the residual carries the token on).
The router runs in float32 (or the input's wider dtype) even under bf16/fp16 autocast.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeflow.errors import ConfigError
from pipeflow.models.aux_loss import attach_aux_loss, current_scope

BALANCES = ("aux_loss", "bias")
# (tokens sorted by expert (n, C), assignments per global expert, this rank's experts) -> their outputs (n, C)
ExpertExchange = Callable[[Tensor, list[int], list[nn.Module]], Tensor]


@dataclass
class MoEConfig:
    """``model.moe``: the GPT's mixture-of-experts blocks (``experts=0``: a dense GPT)."""

    experts: int = 0  # routed experts per MoE block; 0: every block dense
    top_k: int = 2  # experts each token is sent to
    shared_experts: int = 0  # experts every token goes through (one MLP of shared_experts x expert_hidden)
    expert_hidden: int | None = None  # each expert's hidden width H; null: 4 x n_embd
    balance: str = "aux_loss"  # aux_loss (softmax top-k, balancing loss) | bias (DeepSeek's loss-free bias)
    aux_loss_coef: float = 0.01  # the balancing loss's weight (both balances; 0: none)
    z_loss_coef: float = 0.0  # the router z-loss's weight (0: none)
    bias_update_rate: float = 0.001  # balance=bias: the per-step bias step
    capacity_factor: float | None = None  # null: dropless; else capacity per expert over the micro-batch
    every: int = 1  # block k is an MoE block when k % every == 0 (2: alternate MoE and dense)

    def is_moe(self, block: int) -> bool:
        """Whether block `block` of the GPT is a mixture of experts."""
        return self.experts > 0 and block % self.every == 0


def moe_config(value: MoEConfig | dict | None) -> MoEConfig:
    """`value` (a config mapping, as Hydra passes it, or None) as a checked MoEConfig.

    Raises:
        ConfigError: naming the ``model.moe`` key that is out of range.
    """
    cfg = value if isinstance(value, MoEConfig) else MoEConfig(**dict(value or {}))
    if cfg.experts < 0:
        raise ConfigError(f"model.moe.experts={cfg.experts} must be >= 0 (0: a dense model)")
    if cfg.experts == 0:
        return cfg
    checks = (
        (1 <= cfg.top_k <= cfg.experts, f"model.moe.top_k={cfg.top_k} must be in 1..model.moe.experts={cfg.experts}"),
        (cfg.shared_experts >= 0, f"model.moe.shared_experts={cfg.shared_experts} must be >= 0"),
        (cfg.expert_hidden is None or cfg.expert_hidden >= 1, f"model.moe.expert_hidden={cfg.expert_hidden} must be >= 1 or null"),
        (cfg.balance in BALANCES, f"model.moe.balance={cfg.balance!r} must be one of {', '.join(BALANCES)}"),
        (cfg.aux_loss_coef >= 0 and cfg.z_loss_coef >= 0 and cfg.bias_update_rate >= 0,
         "model.moe.aux_loss_coef, z_loss_coef and bias_update_rate must be >= 0"),
        (cfg.capacity_factor is None or cfg.capacity_factor > 0,
         f"model.moe.capacity_factor={cfg.capacity_factor} must be > 0 or null (dropless)"),
        (cfg.every >= 1, f"model.moe.every={cfg.every} must be >= 1"),
    )
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    return cfg


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off on `device_type` (nothing to turn off where autocast does not exist: meta)."""
    try:
        return torch.autocast(device_type, enabled=False)
    except RuntimeError:
        return contextlib.nullcontext()


def combine_experts(tokens: Tensor, rows: Tensor, flat_e: Tensor, flat_g: Tensor, experts: int,
                    run: Callable[[Tensor, list[int]], Tensor]) -> Tensor:
    """The assignments (token ``rows[a]`` to expert ``flat_e[a]`` with gate ``flat_g[a]``) sorted by
    expert, ``run(their tokens, the count per expert)`` giving the experts' outputs in that order
    (locally, or through expert parallelism's exchange), times the gates added back per token:
    (N, C) -> (N, C).  Shared by pipeflow's MoE and the Hugging Face experts under ``parallel.ep``."""
    order = flat_e.argsort(stable=True)
    sizes = _sizes(flat_e, experts)
    rows, flat_g = rows[order], flat_g[order]
    ys = run(tokens[rows], sizes)
    ys = ys * flat_g[:, None].to(ys.dtype)  # (n kept, C)
    return torch.zeros(tokens.shape, dtype=ys.dtype, device=tokens.device).index_add(0, rows, ys)


def _sizes(flat_e: Tensor, experts: int) -> list[int]:
    """Assignments per expert (one host read per layer); on the meta device, where shapes are
    traced without values (the planner's roofline), the balanced load."""
    if flat_e.device.type == "meta":
        n = flat_e.numel()
        return [n // experts + (1 if e < n % experts else 0) for e in range(experts)]
    return _per_expert(flat_e, experts).tolist()


def _per_expert(flat_e: Tensor, experts: int) -> Tensor:
    """How many of the assignments `flat_e` (expert indices) each expert got: (E,) long."""
    return torch.zeros(experts, dtype=torch.long, device=flat_e.device).scatter_add_(0, flat_e, torch.ones_like(flat_e))


class ExpertMLP(nn.Module):
    """One expert: (N, C) -> (N, H) -> GELU -> (N, C)."""

    def __init__(self, n_embd: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, hidden, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(hidden, n_embd, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the expert to its tokens: (n, C) -> (n, C)."""
        return self.c_proj(self.gelu(self.c_fc(x)))


class MoE(nn.Module):
    """Routed experts (and shared ones) in place of a block's MLP: (B, T, C) -> (B, T, C).

    In a training forward (inside :func:`~pipeflow.models.aux_loss.aux_loss_scope`) the layer adds
    up, for the step, its tokens per expert, its dropped assignments and its weighted auxiliary
    loss (:meth:`take_stats`); :meth:`balance` moves the bias from the step's summed counts.
    """

    def __init__(self, n_embd: int, cfg: MoEConfig, bias: bool, dropout: float) -> None:
        super().__init__()
        self.cfg = cfg
        hidden = cfg.expert_hidden or 4 * n_embd
        self.router = nn.Linear(n_embd, cfg.experts, bias=False)
        # keyed by global index: with experts split over ranks (split_experts) names stay the model's
        self.experts = nn.ModuleDict({str(e): ExpertMLP(n_embd, hidden, bias) for e in range(cfg.experts)})
        self.shared = ExpertMLP(n_embd, cfg.shared_experts * hidden, bias) if cfg.shared_experts else None
        self.drop = nn.Dropout(dropout)
        if cfg.balance == "bias":  # moved by the step's counts, not by gradients; saved with the weights
            self.register_buffer("expert_bias", torch.zeros(cfg.experts))
        self._stats: Tensor | None = None  # this step's [tokens per expert (E), dropped, weighted aux]
        self._exchange: ExpertExchange | None = None  # set by split_experts: runs the other ranks' experts

    def forward(self, x: Tensor) -> Tensor:
        """Route every token of x (B, T, C) to its experts and combine their outputs."""
        B, T, C = x.shape
        tokens = x.reshape(B * T, C)  # (N, C)
        logits = self._router_logits(tokens)  # (N, E), float32 at least
        chosen, gates, probs = self._route(logits)  # (N, k) long, (N, k), (N, E)
        counts = _per_expert(chosen.flatten(), self.cfg.experts)  # (E,) assignments per expert
        keep = self._within_capacity(chosen, gates, counts)  # (N, k) bool, or None: dropless
        out = self._dispatch(tokens, chosen, gates, keep)  # (N, C)
        if self.shared is not None:
            out = out + self.shared(tokens)
        out = self.drop(out).view(B, T, C)
        aux = self._aux_loss(logits, probs, counts) if self.training and torch.is_grad_enabled() else None
        if aux is not None:
            out = attach_aux_loss(out, aux)
        self._count(counts, keep, aux)
        return out

    def _router_logits(self, tokens: Tensor) -> Tensor:
        """(N, C) -> (N, E) in float32 (float64 stays float64), autocast off."""
        dtype = torch.promote_types(tokens.dtype, torch.float32)
        with _autocast_off(tokens.device.type):
            return F.linear(tokens.to(dtype), self.router.weight.to(dtype))

    def _route(self, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The k experts of each token, their gates, and the router's probabilities (for the aux loss)."""
        k = self.cfg.top_k
        if self.cfg.balance == "bias":
            scores = torch.sigmoid(logits)  # (N, E)
            chosen = (scores + self.expert_bias.to(scores.dtype)).topk(k, dim=-1).indices  # the bias only chooses
            gates = scores.gather(-1, chosen)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        else:
            probs = logits.softmax(dim=-1)
            gates, chosen = probs.topk(k, dim=-1)
        if k > 1:  # the k gates sum to 1 (with k = 1 the gate stays the probability: the router learns)
            gates = gates / gates.sum(dim=-1, keepdim=True)
        return chosen, gates, probs

    def _within_capacity(self, chosen: Tensor, gates: Tensor, counts: Tensor) -> Tensor | None:
        """Which assignments an expert takes: all (None) when dropless; else at most the capacity
        per expert, the highest gates first (ties: the earlier token)."""
        if self.cfg.capacity_factor is None:
            return None
        capacity = math.ceil(self.cfg.capacity_factor * chosen.numel() / self.cfg.experts)
        flat_e, flat_g = chosen.flatten(), gates.detach().flatten()
        order = flat_g.argsort(descending=True, stable=True)
        order = order[flat_e[order].argsort(stable=True)]  # by expert, within it by gate
        starts = counts.cumsum(0) - counts  # (E,) where each expert's run begins in `order`
        rank = torch.arange(order.numel(), device=order.device) - starts[flat_e[order]]
        keep = torch.empty_like(flat_e, dtype=torch.bool)
        keep[order] = rank < capacity
        return keep.view_as(chosen)

    def _dispatch(self, tokens: Tensor, chosen: Tensor, gates: Tensor, keep: Tensor | None) -> Tensor:
        """Each expert on its tokens, outputs times gates added back per token: (N, C) -> (N, C)."""
        N, k = chosen.shape
        flat_e, flat_g = chosen.flatten(), gates.flatten()
        rows = torch.arange(N, device=tokens.device).repeat_interleave(k)  # (N k,) the token of each assignment
        if keep is not None:
            kept = keep.flatten()
            flat_e, flat_g, rows = flat_e[kept], flat_g[kept], rows[kept]
        experts = list(self.experts.values())
        if self._exchange is None:
            def run(sorted_tokens: Tensor, sizes: list[int]) -> Tensor:
                return torch.cat([expert(t) for expert, t in zip(experts, sorted_tokens.split(sizes))])
        else:  # sent to the ranks holding their experts, run there, sent back in this order
            def run(sorted_tokens: Tensor, sizes: list[int]) -> Tensor:
                return self._exchange(sorted_tokens, sizes, experts)
        return combine_experts(tokens, rows, flat_e, flat_g, self.cfg.experts, run)

    def _aux_loss(self, logits: Tensor, probs: Tensor, counts: Tensor) -> Tensor | None:
        """This micro-batch's balancing loss plus z-loss (None when both weights are 0)."""
        cfg, N = self.cfg, logits.size(0)
        aux = None
        if cfg.aux_loss_coef > 0:  # coef * E * sum_e (count_e / (N k)) * mean_n p_ne
            share = counts.to(probs.dtype) / (N * cfg.top_k)
            aux = cfg.aux_loss_coef * cfg.experts * (share * probs.mean(dim=0)).sum()
        if cfg.z_loss_coef > 0:  # ST-MoE: keeps the router's logits small
            z = cfg.z_loss_coef * torch.logsumexp(logits, dim=-1).square().mean()
            aux = z if aux is None else aux + z
        return aux

    def _count(self, counts: Tensor, keep: Tensor | None, aux: Tensor | None) -> None:
        """Add the micro-batch's figures to the step's (training forwards only)."""
        scope = current_scope()
        if scope is None:
            return
        dropped = counts.new_zeros(()) if keep is None else (~keep).sum()
        weighted = aux.detach().double() * scope.weight if aux is not None else counts.new_zeros((), dtype=torch.float64)
        row = torch.cat([counts.double(), dropped.double().reshape(1), weighted.reshape(1)])
        self._stats = row if self._stats is None else self._stats + row

    def take_stats(self) -> Tensor:
        """The step's ``[tokens per expert (E), dropped assignments, weighted aux loss]`` (float64,
        zeros when no training forward ran), cleared."""
        stats, self._stats = self._stats, None
        if stats is None:
            stats = torch.zeros(self.cfg.experts + 2, dtype=torch.float64, device=self.router.weight.device)
        return stats

    def split_experts(self, rank: int, ranks: int, exchange: ExpertExchange) -> None:
        """Keep experts ``rank * E / ranks ..`` (by global index) of the `ranks` sharing this layer;
        `exchange` runs every token's experts where they are (expert parallelism, applied by
        ``pipeflow.runtime.parallel.expert_parallel``).

        Raises:
            ConfigError: `ranks` does not divide the experts.
        """
        E = self.cfg.experts
        if E % ranks:
            raise ConfigError(f"parallel.ep={ranks} does not divide model.moe.experts={E}: each ep rank holds "
                              f"experts/ep of them; choose an ep that divides {E}")
        per = E // ranks
        self.experts = nn.ModuleDict({str(e): self.experts[str(e)] for e in range(rank * per, (rank + 1) * per)})
        self._exchange = exchange

    def balance(self, counts: Tensor) -> None:
        """balance=bias: move each expert's bias towards the mean load by the step's tokens per
        expert `counts` (E,), summed over micro-batches and data-parallel ranks."""
        if self.cfg.balance != "bias":
            return
        step = self.cfg.bias_update_rate * torch.sign(counts.mean() - counts)
        self.expert_bias.add_(step.to(self.expert_bias.dtype))
