"""What a layer's tensor-parallel plan would split and send, seen during one forward: the
``LayerProfile.tp_*`` figures the planner costs tp's collectives from."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from pipeflow.models.spec import ModelSpec


class TensorTraffic:
    """What layer `index`'s tensor-parallel plan would split and send (``LayerProfile.tp_*``): the
    plan for tp = 2 (a model without one, or one tp = 2 cannot split, splits nothing), and the
    sizes of its modules' inputs and outputs, seen by hooks during one forward."""

    FORWARD = {"rowwise": 1.0, "embedding": 1.0, "colwise_out": 0.5}  # output: summed, or gathered (half)
    BACKWARD = ("colwise", "colwise_whole", "colwise_qkv", "colwise_out")  # input gradient summed

    def __init__(self, spec: ModelSpec, index: int, module: nn.Module) -> None:
        from pipeflow.errors import ConfigError

        self.total = sum(p.numel() for p in module.parameters())
        self.plan: dict[str, str] = {}
        if spec.tp_plan is not None:
            try:
                self.plan = spec.tensor_plan(index, module, 2)
            except ConfigError:
                self.plan = {}
        sends = [path for path, style in self.plan.items() if style in self.FORWARD or style in self.BACKWARD]
        self.split = sum(p.numel() for path in sends for p in module.get_submodule(path).parameters())
        self.norm_bytes = sum(p.numel() * p.element_size() for path, style in self.plan.items() if style == "norm"
                              for p in module.get_submodule(path).parameters())
        self.bytes: dict[str, tuple[int, int]] = {}
        self.hooks = [module.get_submodule(path).register_forward_hook(self._hook(path)) for path in sends]

    def _hook(self, path: str) -> Callable:
        def record(mod: nn.Module, args: tuple, out: Any) -> None:
            self.bytes.setdefault(path, (tensor_bytes(args), tensor_bytes(out)))
        return record

    def stop(self) -> None:
        """Remove the hooks (after the warm-up forward)."""
        for hook in self.hooks:
            hook.remove()

    def figures(self) -> dict[str, Any]:
        """The ``LayerProfile.tp_*`` fields."""
        forward = sum(self.FORWARD[s] * self.bytes.get(p, (0, 0))[1] for p, s in self.plan.items() if s in self.FORWARD)
        backward = sum(self.bytes.get(p, (0, 0))[0] for p, s in self.plan.items() if s in self.BACKWARD)
        return {"tp_split": self.split / self.total if self.total else 0.0, "tp_forward_bytes": int(forward),
                "tp_backward_bytes": int(backward),
                "tp_forward_collectives": sum(1 for s in self.plan.values() if s in self.FORWARD),
                "tp_backward_collectives": sum(1 for s in self.plan.values() if s in self.BACKWARD),
                "tp_norm_bytes": self.norm_bytes}


def tensor_bytes(value: Any) -> int:
    """Bytes of the floating tensors in `value` (a tensor or a tuple of them)."""
    if isinstance(value, Tensor):
        return value.numel() * value.element_size() if value.is_floating_point() else 0
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(v) for v in value)
    return 0
