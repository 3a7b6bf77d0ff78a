"""One model chunk on one rank: forward, backward (full or split into B and W), activations kept.

A Stage knows nothing about communication: it is handed input tuples and output gradients and
returns outputs and input gradients.  Index letters: s = stage, i = micro-batch.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeflow.errors import ScheduleError
from pipeflow.models.aux_loss import aux_loss_scope, shape_trial
from pipeflow.models.spec import ModelSpec, run_layers
from pipeflow.runtime.compiled_backward import deferring_weight_grads
from pipeflow.runtime.keyed_dropout import SampleKeys, run_keyed
from pipeflow.runtime.precision import to_compute_dtype
from pipeflow.runtime.parallel.tensor_parallel import like_param

Tensors = tuple[torch.Tensor, ...]
_ENGINE = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]


def run_backward(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor] | None,
    inputs: Sequence[torch.Tensor] | None = None,
    retain_graph: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """Backward from `roots` through the autograd engine directly, as Megatron's custom_backward.

    ``torch.autograd.backward``/``grad`` check each grad's shape against its root; a root whose
    storage was freed after its send (:meth:`Stage.deallocate_outputs`) has shape (0,) now, so
    they would refuse.  With no `inputs` the gradients accumulate into the leaves' ``.grad``
    (a full backward); with `inputs` (even empty) their gradients are returned instead (None
    where unused).

    Args:
        roots: the tensors to differentiate (each requires grad).
        grads: one gradient per root, or None for scalar roots (the loss): ones.
        inputs: tensors to return gradients for; None to accumulate into ``.grad``.
        retain_graph: keep the graph for a later pass (the W of a split backward).
    """
    roots = tuple(roots)
    if not roots:
        return (None,) * len(inputs or ())
    if grads is None:
        grads = tuple(torch.ones_like(t, memory_format=torch.preserve_format) for t in roots)
    if inputs is None:
        return _ENGINE.run_backward(roots, tuple(grads), retain_graph, False, (), True, True)
    if not inputs:
        return ()
    return _ENGINE.run_backward(roots, tuple(grads), retain_graph, False, tuple(inputs), True, False)


def as_tuple(value: Any) -> Tensors:
    """A layer output (Tensor or tuple of Tensors) as a tuple."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def unpack(values: Tensors) -> Any:
    """A one-element tuple as its tensor, longer tuples unchanged (the model input convention)."""
    return values[0] if len(values) == 1 else values


class Stage:
    """Runs stage `index` of `num_stages` for one micro-batch at a time.

    Args:
        index: the stage index s.
        num_stages: S, the total number of stages.
        layers: this stage's layers, in order.
        loss_fn: (last layer output, targets) -> mean loss; used on the last stage only.
        compute_dtype: the autocast dtype (``train.precision``); None: autocast off.
        checkpoint_every: recompute layers 0, n, 2n, ... in backward; 0: off.
        split_backward: whether backward may be split into B and W (``weights=False``): only then
            are every layer's outputs kept from forward to backward. The Pipeline sets it from its
            program (a W action of this stage).
    """

    def __init__(
        self,
        index: int,
        num_stages: int,
        layers: Sequence[nn.Module],
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
        compute_dtype: torch.dtype | None = None,
        checkpoint_every: int = 0,
        split_backward: bool = True,
    ) -> None:
        self.index = index
        self.num_stages = num_stages
        self.module = nn.ModuleList(layers)
        self.loss_fn = loss_fn
        self._inputs: dict[int, Tensors] = {}
        self._outputs: dict[int, Tensors] = {}
        self._boundaries: dict[int, list[Tensors]] = {}  # each layer's outputs, for a split backward
        self._freeable: dict[int, Tensors] = {}  # the kept outputs whose storage may go once sent
        self._pending_weight: dict[int, list[tuple[list[torch.Tensor], list[torch.Tensor]]]] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.compute_dtype = compute_dtype
        self.checkpoint_every = checkpoint_every
        self.split_backward = split_backward
        # Training forwards only: called as hook(stage, i) before micro-batch i runs, and as
        # outputs = hook(stage, i, outputs) on what it hands to the pipeline (guards, drills).
        self.pre_forward_hooks: list[Callable[[Stage, int], None]] = []
        self.forward_hooks: list[Callable[[Stage, int, Tensors], Tensors]] = []
        self.sample_keys: SampleKeys | None = None  # this step's keyed dropout (train.dropout_rng=sample)

    @property
    def is_first(self) -> bool:
        """True for stage 0, which reads the model input."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """True for stage S-1, which computes the loss."""
        return self.index == self.num_stages - 1

    def parameters(self) -> list[nn.Parameter]:
        """This stage's parameters."""
        return list(self.module.parameters())

    def activations_held(self) -> int:
        """How many micro-batches' activations this stage keeps for backward."""
        return len(set(self._outputs) | set(self._pending_weight))

    def kept_tensors(self, i: int) -> list[torch.Tensor]:
        """What the stage itself keeps of micro-batch `i` until its backward: its inputs, its
        outputs and, for a split backward, each layer's outputs (offloading leaves them be)."""
        kept = [*self._inputs.get(i, ()), *self._outputs.get(i, ())]
        return kept + [t for outs in self._boundaries.get(i, ()) for t in outs]

    def forward(
        self,
        i: int,
        inputs: Tensors,
        target: torch.Tensor | None = None,
        loss_scale: float = 1.0,
        keep_for_backward: bool = True,
        grad_scale: float = 1.0,
    ) -> Tensors:
        """Run micro-batch `i` through the stage.

        On the last stage the loss ``loss_fn(output, target) * loss_scale`` is computed and kept
        (``self.losses[i]``); the returned tuple is then the loss alone.  A micro-batch weighed 0
        (every target masked) has a zero loss, its gradients zero: a mean over no targets is NaN.

        Args:
            i: micro-batch index.
            inputs: the stage inputs; received float tensors already require grad.
            target: the micro-batch targets (last stage, training or evaluation with loss).
            loss_scale: factor that makes the sum over micro-batches equal the full-batch loss; the
                weight of the auxiliary losses that layers attach in a training forward too.
            keep_for_backward: False for evaluation (no graph is built or kept, no hooks run).
            grad_scale: the fp16 loss scale, applied to the loss backward starts from only.
        """
        if keep_for_backward:
            for pre_hook in self.pre_forward_hooks:
                pre_hook(self, i)
        # a layer's auxiliary loss (an MoE router's) is weighted as this micro-batch's loss
        scope = aux_loss_scope(loss_scale, grad_scale) if keep_for_backward else contextlib.nullcontext()
        with torch.set_grad_enabled(keep_for_backward), self._autocast(inputs), scope:
            keys = self.sample_keys.of(i) if keep_for_backward and self.sample_keys is not None else None
            output, boundaries, handed = self._run(inputs, keep_for_backward, keep_for_backward and self.split_backward,
                                                   keys)
            outputs = self._to_compute_dtype(as_tuple(output))
            if self.is_last and target is not None and self.loss_fn is not None:
                loss = self.loss_fn(output, target) * loss_scale if loss_scale != 0 else _zero_loss(outputs)
                self.losses[i] = loss.detach()
                outputs = (loss * grad_scale if grad_scale != 1.0 else loss,)
        if keep_for_backward:
            self._inputs[i] = inputs
            self._outputs[i] = outputs
            self._freeable[i] = tuple(t for t in outputs if id(t) not in handed)
            if self.split_backward:
                self._boundaries[i] = boundaries
            for hook in self.forward_hooks:
                outputs = hook(self, i, outputs)
        return outputs

    def _run(self, inputs: Tensors, grad: bool, keep_boundaries: bool,
             keys: tuple[int, int] | None = None) -> tuple[Any, list[Tensors], set[int]]:
        """The layers on `inputs` (run_layers' convention), their keyed dropout drawn from `keys`.

        Returns:
            The last layer's output; each layer's outputs (when `keep_boundaries`, else empty);
            the ids of every tensor handed to a layer (one such may have been saved by it).
        """
        output, boundaries, handed = unpack(inputs), [], set()
        for k, layer in enumerate(self.module):
            handed.update(id(t) for t in as_tuple(output))
            output = self._call(k, layer if keys is None else functools.partial(run_keyed, keys, layer), output, grad)
            if keep_boundaries:
                boundaries.append(as_tuple(output))
        return output, boundaries, handed

    def _autocast(self, inputs: Tensors = ()) -> contextlib.AbstractContextManager:
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        first = next(self.module.parameters(), None)
        device = first.device if first is not None else inputs[0].device if inputs else torch.device("cpu")
        return torch.autocast(device.type, dtype=self.compute_dtype)

    def _call(self, k: int, layer: Callable[..., Any], output: Any, grad: bool) -> Any:
        """Layer k on `output`; checkpointed (recomputed in backward) when configured."""
        args = output if isinstance(output, tuple) else (output,)
        if grad and self.checkpoint_every and k % self.checkpoint_every == 0:
            return checkpoint(layer, *args, use_reentrant=False)
        return layer(*args)

    def _to_compute_dtype(self, outputs: Tensors) -> Tensors:
        """Floating outputs of a non-last stage in the compute dtype: what travels to the next stage."""
        return outputs if self.is_last else to_compute_dtype(outputs, self.compute_dtype)

    def deallocate_outputs(self, i: int) -> None:
        """Free the storage of micro-batch `i`'s kept outputs, keeping their autograd nodes.

        The pipeline calls this once the outputs are on their way to the next stage (it holds
        the detached tensors being sent until their sends complete, so the memory goes with
        them): backward only needs the outputs' grad_fn, not their values (Megatron's
        ``deallocate_output_tensor``).  Views and leaves (an output that is an input or aliases
        one) are left alone, and so is an output that was handed to a layer of this stage (a
        tuple element passed through a later layer, which may have saved it for backward:
        autograd saves an op's input as that very tensor, so freeing it would break backward).
        """
        for t in self._freeable.pop(i, ()):
            if t.grad_fn is not None and t._base is None and t.numel() > 0:
                t.data = torch.empty((0,), dtype=t.dtype, device=t.device)

    def backward(self, i: int, grad_outputs: Tensors | None, weights: bool = True) -> tuple[torch.Tensor | None, ...]:
        """Backward of micro-batch `i`; returns the gradients of the stage inputs.

        Args:
            i: micro-batch index.
            grad_outputs: gradients of the outputs that require grad, in order (None on the
                last stage, whose output is the loss).
            weights: True for a full backward (parameter grads accumulated now); False for the
                input-grad half (B) of a split backward, whose weight half runs in
                :meth:`backward_weight`.

        Returns:
            One entry per input: its gradient, or None for inputs that need none.
        """
        if not weights and i not in self._boundaries:
            raise ScheduleError(f"stage {self.index}, micro-batch {i}: a split backward (B without W) needs each "
                                f"layer's outputs, which a stage keeps only with split_backward=True (here "
                                f"{self.split_backward}) from a training forward")
        inputs, outputs = self._inputs.pop(i), self._outputs.pop(i)
        self._freeable.pop(i, None)
        tensors = [t for t in outputs if t.requires_grad]
        grads = None if grad_outputs is None else list(grad_outputs)
        if grads is not None and len(grads) != len(tensors):
            raise ValueError(
                f"stage {self.index}, micro-batch {i}: got {len(grads)} output gradients for "
                f"{len(tensors)} outputs that require grad"
            )
        wanted = [t for t in inputs if t.requires_grad]
        boundaries = self._boundaries.pop(i, [])
        if weights:
            run_backward(tensors, grads)
            found = {id(t): t.grad if t.is_leaf else None for t in wanted}  # a view's .grad is never filled
        else:
            found = self._backward_input(i, tensors, grads, wanted, boundaries)
        return tuple(found.get(id(t)) if t.requires_grad else None for t in inputs)

    def _backward_input(
        self,
        i: int,
        roots: list[torch.Tensor],
        root_grads: list[torch.Tensor] | None,
        wanted: list[torch.Tensor],
        boundaries: list[Tensors],
    ) -> dict[int, torch.Tensor | None]:
        """B of a split backward: input grads, plus the grads at every layer's outputs for W.

        One pass down the chain computes both; W then only walks each layer's own sub-graph
        from its outputs to its parameters, never the chain again.  A compiled layer's backward
        runs its input half here and leaves its weight half for W (runtime/compiled_backward.py).
        """
        per_layer = [[t for t in outs if t.requires_grad] for outs in boundaries]
        flat = [t for outs in per_layer for t in outs]
        with deferring_weight_grads():
            got = run_backward(roots, root_grads, wanted + flat, retain_graph=True)
        grads_in, rest = got[: len(wanted)], list(got[len(wanted):])
        pending = []
        for layer_outs in per_layer:
            layer_grads, rest = rest[: len(layer_outs)], rest[len(layer_outs):]
            keep = [(t, g) for t, g in zip(layer_outs, layer_grads) if g is not None]
            pending.append(([t for t, _ in keep], [g for _, g in keep]))
        self._pending_weight[i] = pending
        return {id(t): g for t, g in zip(wanted, grads_in)}

    def backward_weight(self, i: int) -> None:
        """The weight-grad half (W) of a split backward for micro-batch `i`."""
        for layer, (outs, grads) in zip(self.module, self._pending_weight.pop(i)):
            params = [p for p in layer.parameters() if p.requires_grad]
            if not outs or not params:
                continue
            for p, g in zip(params, run_backward(outs, grads, params)):
                if g is not None:
                    g = like_param(p, g)  # a tp-split weight's gradient in the weight's own placement
                    p.grad = g if p.grad is None else p.grad + g

    def trial_forward(self, inputs: Tensors) -> Tensors:
        """Run the layers once in eval mode (no BatchNorm update, no dropout RNG) to see outputs.

        The graph is built (grad enabled) so that the outputs' ``requires_grad`` is what a
        training forward gives; it is dropped on return.
        """
        modes = [(mod, mod.training) for mod in self.module.modules()]
        self.module.train(False)
        try:  # compiled layers (train.compile) run eager: a shape is not worth an eval-mode graph
            with torch.enable_grad(), self._autocast(inputs), _eager(), shape_trial():  # ranks try unevenly
                outputs = self._to_compute_dtype(as_tuple(run_layers(list(self.module), unpack(inputs))))
                return tuple(t.detach().requires_grad_(t.requires_grad) for t in outputs)
        finally:
            for mod, mode in modes:
                mod.training = mode

    def take_loss(self) -> torch.Tensor | None:
        """The sum of the kept micro-batch losses (last stage), clearing them; None elsewhere."""
        if not self.losses:
            return None
        total = torch.stack(list(self.losses.values())).sum()
        self.losses.clear()
        return total


def _zero_loss(outputs: Tensors) -> torch.Tensor:
    """A zero loss tied to the stage's outputs, so backward runs and every gradient is zero: the
    loss of a micro-batch whose every target is masked (its own mean would be 0 / 0)."""
    floats = [t for t in outputs if torch.is_tensor(t) and t.is_floating_point()]
    if not floats:
        return torch.zeros(())
    total = floats[0].sum()  # no plain zero to start from: the outputs may be DTensors (tp)
    for t in floats[1:]:
        total = total + t.sum()
    return total * 0.0


def _eager() -> contextlib.AbstractContextManager:
    """Compiled functions run eagerly within the block (``torch.compiler.set_stance``, torch >= 2.6)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def build_stages(
    spec: ModelSpec,
    ranges: Sequence[range],
    stage_ids: Sequence[int],
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    compute_dtype: torch.dtype | None = None,
    checkpoint_every: int = 0,
) -> dict[int, Stage]:
    """Build the stages `stage_ids` of `spec` split by `ranges`; only their layers are built.

    `compute_dtype` and `checkpoint_every` are every stage's (see :class:`Stage`).
    """
    return {
        s: Stage(s, len(ranges), spec.build_layers(ranges[s], device, dtype), spec.loss_fn, compute_dtype, checkpoint_every)
        for s in stage_ids
    }


def layers_by_index(stages: dict[int, Stage], ranges: Sequence[range]) -> dict[int, nn.Module]:
    """This rank's built layers keyed by their index in the whole model."""
    return {i: layer for s, stage in stages.items() for i, layer in zip(ranges[s], stage.module)}
