"""A Hugging Face family's routers, counted and trained as pipeflow's own MoE layers are.

Each router module (the class the model records ``router_logits`` from: ``MixtralTopKRouter``,
``DeepseekV3TopkRouter`` ...) returns ``(router_logits, top_k_weights, top_k_index)``.  A
:class:`RouterFigures` hooked on it adds up, over a step's training forwards, the tokens each
expert got and the weighted auxiliary loss, which the step's one all-reduce sums over ranks and
rank 0 reports (``MoE layer l: tokens per expert ... | imbalance``), as for the built-in MoE.

**The auxiliary loss per layer.**  Where the config asks for it (``output_router_logits`` with a
``router_aux_loss_coef`` above 0), each MoE layer adds ``router_aux_loss_coef x`` the family's own
``load_balancing_loss_func`` of *its own* router logits and micro-batch (Megatron's and
DeepSeek's form), attached to the layer's output for backward (:func:`~pipeflow.models.aux_loss.
attach_aux_loss`): a router in a middle stage cannot send its loss to the last one.  transformers
instead applies the function once to every layer's logits concatenated, which couples the layers
(the product of the summed fractions is not the sum of the products) and needs every layer's
logits on one rank; summed over the layers, pipeflow's is the Switch loss of each layer.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from pipeflow.models.aux_loss import attach_aux_loss, current_scope

ROUTING = "_pipeflow_routing"  # the attribute a router module's RouterFigures hangs on
CORRECTION_BIAS = "e_score_correction_bias"  # the per-expert bias of aux-loss-free balancing (a float32 buffer)


class RouterFigures:
    """One Hugging Face router's step figures, and its per-layer auxiliary loss.

    Args:
        router: the router module (hooked: each training forward is counted).
        experts: routed experts of the layer.
        top_k: experts per token.
        aux: ``aux(logits) -> loss`` (the family's balancing loss of this layer's logits, times its
            coefficient), or None: no auxiliary loss.
    """

    def __init__(self, router: nn.Module, experts: int, top_k: int, aux: Callable[[Tensor], Tensor] | None,
                 bias_update_rate: float = 0.0) -> None:
        self.experts, self.top_k, self.aux = experts, top_k, aux
        self.bias: Tensor | None = getattr(router, CORRECTION_BIAS, None)  # DeepSeek-V3's, a buffer
        self.rate = bias_update_rate
        self._stats: Tensor | None = None
        self._pending: list[Tensor] = []  # this forward's aux losses, attached by the decoder layer's adapter
        router.register_forward_hook(self._seen)
        setattr(router, ROUTING, self)

    def _seen(self, module: nn.Module, inputs: Any, output: Any) -> None:
        logits, indices = output[0], output[-1]
        aux = self.aux(logits) if self.aux is not None and torch.is_grad_enabled() else None
        if aux is not None:  # attached with the running micro-batch's weight (0 outside a training forward)
            self._pending.append(aux)
        scope = current_scope()
        if scope is None:  # evaluation, shape trials, a recomputation: no step's figures
            return
        counts = torch.bincount(indices.reshape(-1), minlength=self.experts).double()
        weighted = aux.detach().double() * scope.weight if aux is not None else counts.new_zeros(())
        row = torch.cat([counts, counts.new_zeros(1), weighted.reshape(1)])
        self._stats = row if self._stats is None else self._stats + row

    def attach(self, hidden: Tensor) -> Tensor:
        """`hidden` (the layer's output) carrying this forward's auxiliary losses for backward."""
        while self._pending:
            hidden = attach_aux_loss(hidden, self._pending.pop())
        return hidden

    def take_stats(self) -> Tensor:
        """The step's ``[tokens per expert (E), dropped (0: dropless), weighted aux loss]``
        (float64, zeros when no training forward ran), cleared."""
        stats, self._stats = self._stats, None
        return stats if stats is not None else torch.zeros(self.experts + 2, dtype=torch.float64)

    def balance(self, counts: Tensor) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): move each expert's correction bias by
        ``bias_update_rate`` towards the mean load, by the step's tokens per expert `counts` (E,)
        summed over micro-batches and ranks (the same on every rank, so every replica agrees);
        outside the optimizer, in the bias's own dtype.  A no-op for a router without that bias."""
        if self.bias is None or self.rate <= 0:
            return
        step = self.rate * torch.sign(counts.mean() - counts)
        with torch.no_grad():
            self.bias.add_(step.to(self.bias.device, self.bias.dtype))


def watch_routers(root: nn.Module, layer: nn.Module, bias_update_rate: float = 0.0) -> list[RouterFigures]:
    """A :class:`RouterFigures` on every router of `layer` (a piece of the model `root`, a
    ``*ForCausalLM``): the modules of the class its model records ``router_logits`` from; a
    router with a correction bias moves it by `bias_update_rate` per step."""
    recorded = getattr(type(root), "_can_record_outputs", None) or {}
    cls = getattr(recorded.get("router_logits"), "target_class", None)
    if cls is None:
        return []
    experts, top_k = routed_experts(root.config), int(getattr(root.config, "num_experts_per_tok", 0))
    aux = _aux_loss(root, experts, top_k)
    return [RouterFigures(module, experts, top_k, aux, bias_update_rate) for module in layer.modules()
            if isinstance(module, cls)]


def _aux_loss(root: nn.Module, experts: int, top_k: int) -> Callable[[Tensor], Tensor] | None:
    """``coef x load_balancing_loss_func((logits,), E, k)`` of the family, where its config asks for
    the loss (``output_router_logits`` and ``router_aux_loss_coef`` > 0); else None."""
    config = root.config
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    function = getattr(inspect.getmodule(type(root)), "load_balancing_loss_func", None)
    if not getattr(config, "output_router_logits", False) or coef <= 0 or function is None:
        return None
    return lambda logits: coef * function((logits,), experts, top_k, None)


def routed_experts(config: Any) -> int:
    """The routed experts per MoE layer a Hugging Face config declares (0: a dense model)."""
    return int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
               or getattr(config, "n_routed_experts", None) or 0)
