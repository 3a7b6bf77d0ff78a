"""Checkpoint names -> the model's tensors, as ``transformers`` loads them: its own conversion
mapping (``transformers.conversion_mapping``) renames a checkpoint's keys and fuses per-expert
tensors (``experts.3.w1.weight`` ...) into the 3-D expert weights its MoE modules hold
(``experts.gate_up_proj``).

:func:`checkpoint_sources` reads only names (the files' headers) and says, for each tensor of the
model, which checkpoint tensors make it and how: a name, or a :class:`Fused` (the sources per
pattern in expert order, then stacked and concatenated as the mapping's operations say).  A layer
then reads only its own sources.  Operations other than stacking a module list and concatenating
(quantized formats, vision permutations) are refused by name.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pipeflow.errors import ConfigError

_OPS = {"MergeModulelist": "stack", "Concatenate": "cat"}  # transformers' op -> what it does here


@dataclass(frozen=True)
class Fused:
    """A model tensor made of several checkpoint tensors.

    Attributes:
        sources: for each source pattern (in the mapping's order), the checkpoint names it
            matched, in expert order.
        ops: ``("stack", dim)``: stack each pattern's list; ``("cat", dim)``: concatenate the
            patterns' results (transformers' ``MergeModulelist`` and ``Concatenate``).
    """

    sources: tuple[tuple[str, ...], ...]
    ops: tuple[tuple[str, int], ...]

    def names(self) -> list[str]:
        """Every checkpoint name it reads."""
        return [name for group in self.sources for name in group]

    def shape(self, shapes: dict[str, list[int]]) -> list[int]:
        """The fused tensor's shape from its sources' shapes (headers only)."""
        return list(self.assemble(lambda name: torch.empty(shapes[name], device="meta")).shape)

    def assemble(self, read: Callable[[str], Tensor], rows: tuple[int, int] | None = None) -> Tensor:
        """The fused tensor from ``read(name)`` of each source; with `rows` ``(lo, hi)``, only its
        experts ``lo .. hi``, reading only their sources where the experts are stacked first."""
        if rows is not None and not self._experts_first():
            return self.assemble(read)[rows[0]:rows[1]]
        groups = [group[rows[0]:rows[1]] if rows is not None else group for group in self.sources]
        parts: list[Any] = [[read(name) for name in group] for group in groups]
        for op, dim in self.ops:
            if op == "stack":
                parts = [torch.stack(group, dim) for group in parts]
            else:
                parts = [torch.cat(parts, dim)]
        (whole,) = parts
        return whole

    def _experts_first(self) -> bool:
        """Whether the expert lists are stacked on dim 0 and concatenated on another (so expert e's
        rows come from each list's e-th source alone)."""
        return all(dim == 0 for op, dim in self.ops if op == "stack") and all(
            dim != 0 for op, dim in self.ops if op == "cat")


def _expert_order(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def checkpoint_sources(model: nn.Module, names: Iterable[str]) -> dict[str, str | Fused]:
    """For each model tensor a checkpoint with `names` holds (after transformers' conversion
    mapping for `model`, a ``PreTrainedModel``): the checkpoint name, or the :class:`Fused` made of
    several.  Names the mapping leaves alone map to themselves.

    Raises:
        ConfigError: the mapping fuses with an operation model=hf does not apply.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # a transformers without conversion mappings: names as they are
        return {name: name for name in names}
    transforms = get_model_conversion_mapping(model, add_legacy=False)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    direct: dict[str, str] = {}
    fused: dict[str, dict[str, list[str]]] = {}
    owner: dict[str, Any] = {}
    for name in names:
        target, pattern = rename_source_key(name, renamings, converters)
        if pattern is None:
            direct[target] = name
            continue
        fused.setdefault(target, {}).setdefault(pattern, []).append(name)
        owner[target] = next(c for c in converters if pattern in c.source_patterns
                             or pattern in c._original_source_patterns)
    out: dict[str, str | Fused] = dict(direct)
    for target, groups in fused.items():
        converter = owner[target]
        ops = []
        for op in converter.operations:
            kind = _OPS.get(type(op).__name__)
            if kind is None:
                raise ConfigError(f"the checkpoint's tensors for {target!r} are converted by transformers with "
                                  f"{type(op).__name__}, which model=hf does not apply (it stacks expert lists and "
                                  f"concatenates); convert the folder with from_pretrained and save_pretrained first")
            ops.append((kind, int(getattr(op, "dim", 0))))
        patterns = list(dict.fromkeys(p for p in (*converter.source_patterns, *converter._original_source_patterns)
                                      if p in groups))
        out[target] = Fused(tuple(tuple(sorted(groups[p], key=_expert_order)) for p in patterns), tuple(ops))
    return out
