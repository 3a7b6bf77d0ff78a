"""Pieces of an existing nn.Module, kept under their own attribute paths, as pipeline layers.

A `Piece` holds some of a model's submodules, parameters and buffers at the paths they have in
the model (``tok_emb``, ``encoder.pos_embedding``, ``blocks.3``), so its state dict keys are the
model's own and an adapter can be written against the model's attribute names
(``m.tok_emb(idx) + m.pos_emb(pos)``). Without an adapter, a piece calls its paths in order
(`run_layers`' convention).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

from torch import Tensor, nn

from pipeflow.errors import ConfigError
from pipeflow.models.spec import run_layers

Adapter = Callable[..., Any]  # (piece, *inputs) -> output, written with the model's attribute names


def resolve(root: nn.Module, path: str) -> Any:
    """The submodule, parameter or buffer of `root` at `path` ("" is `root` itself).

    Raises:
        ConfigError: nothing is at `path`; the message lists what is at its parent.
    """
    obj: Any = root
    for part in path.split(".") if path else []:
        if isinstance(obj, nn.Module) and (part in obj._modules or part in obj._parameters or part in obj._buffers):
            obj = getattr(obj, part)
        else:
            parent = path.rpartition(".")[0] or "<the model>"
            known = [*obj._modules, *obj._parameters, *obj._buffers] if isinstance(obj, nn.Module) else []
            raise ConfigError(f"{type(root).__name__} has no submodule, parameter or buffer {path!r}; "
                              f"{parent} holds {known}")
    return obj


def _owner(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent, _, leaf = path.rpartition(".")
    return (resolve(root, parent) if parent else root), leaf


class Piece(nn.Module):
    """Some of a model's parts under their paths; ``forward`` runs `adapter` or the paths in order.

    Args:
        paths: the parts' attribute paths in the model, in call order.
        adapter: ``adapter(piece, *inputs)``; None: call the paths in order.
    """

    def __init__(self, paths: Sequence[str], adapter: Adapter | None = None) -> None:
        super().__init__()
        self.paths = list(paths)
        self.adapter = adapter

    def attach(self, path: str, value: Any, persistent: bool = True) -> None:
        """Put a module, parameter or buffer at `path`, making plain containers on the way."""
        node: nn.Module = self
        parts = path.split(".")
        for part in parts[:-1]:
            if part not in node._modules:
                node.add_module(part, nn.Module())
            node = node._modules[part]  # type: ignore[assignment]
        leaf = parts[-1]
        if isinstance(value, nn.Parameter):
            node.register_parameter(leaf, value)
        elif isinstance(value, nn.Module):
            node.add_module(leaf, value)
        else:
            node.register_buffer(leaf, value, persistent=persistent)

    def forward(self, *inputs: Any) -> Any:
        """Run the adapter on the inputs, or chain the modules at `paths`."""
        if self.adapter is not None:
            return self.adapter(self, *inputs)
        modules = [resolve(self, path) for path in self.paths]
        not_callable = [p for p, m in zip(self.paths, modules) if not isinstance(m, nn.Module)]
        if not_callable:
            raise ConfigError(f"{not_callable} are parameters or buffers, not modules: a piece holding them needs "
                              f"an adapter (before_fn / after_fn) that says how they are used")
        return run_layers(modules, inputs[0] if len(inputs) == 1 else inputs)


def cut(root: nn.Module, paths: Sequence[str], adapter: Adapter | None = None) -> Piece:
    """A `Piece` holding copies of `root`'s parts at `paths` (shared tensors stay shared within it).

    The copies are deep: a Piece cut from a meta skeleton owns its own meta tensors, to be
    materialised without touching the skeleton.
    """
    piece = Piece(paths, adapter)
    for path in paths:
        value = resolve(root, path)
        owner, leaf = _owner(root, path)
        persistent = leaf not in owner._non_persistent_buffers_set
        if not isinstance(value, (nn.Module, Tensor)):
            raise ConfigError(f"{path!r} is a {type(value).__name__}; a path must name a module, parameter or buffer")
        piece.attach(path, value, persistent)
    memo: dict[int, Any] = {id(adapter): adapter}
    return copy.deepcopy(piece, memo)


def expand(root: nn.Module, path: str) -> list[str]:
    """The paths of the children of the container at `path` ("": the root), in order.

    Raises:
        ConfigError: the module at `path` has no children.
    """
    container = resolve(root, path)
    if not isinstance(container, nn.Module) or not container._modules:
        raise ConfigError(f"blocks={path!r} must name a module whose children are the blocks "
                          f"(an nn.ModuleList or nn.Sequential); {type(container).__name__} has none")
    return [f"{path}.{name}" if path else name for name in container._modules]


def claims(path: str, key: str) -> bool:
    """True when the part at `path` holds the tensor `key` (``blocks.1`` holds ``blocks.1.w``)."""
    return key == path or key.startswith(path + ".") or path == ""
