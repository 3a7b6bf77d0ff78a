"""`from_module`: the nn.Module you already have, split into pipeline layers without rewriting it.

Three forms:

- an ``nn.Sequential`` as it is: each child a layer, or ``groups`` of children by name;
- the blocks form, for a forward that is "prefix modules -> a loop over a ModuleList of blocks ->
  suffix modules": ``from_module(model, before=["tok_emb", "pos_emb"], blocks="blocks",
  after=["ln_f", "head"], before_fn=..., after_fn=...)``; an adapter ``fn(piece, *inputs)`` says
  what the prefix or suffix does when it is more than calling its modules in order, written with
  the model's own attribute names (``piece.tok_emb(idx) + piece.pos_emb(pos)``);
- the traced form, any forward split at named submodules: ``from_module(model,
  split_points=["blocks.2", "head"])`` (torch.fx; see `pipeflow.models.traced`).

Pass a constructor (``lambda: MyGPT(cfg)``, a class, a ``functools.partial``) and each rank
builds only its own layers: the model is built with its parameters on the ``meta`` device
(`pipeflow.models.materialise`), and a layer's parameters are made real only when that layer is
built, initialised by its modules' own ``reset_parameters`` under the layer's seed (plus the
``init`` hook for initialisation the constructor does beyond that), or read from ``init_from``,
a state dict file of the unsplit model. Pass a built module instead and its weights are used as
they are. Parameters shared between layers (tied embeddings) become `ModelSpec.tied` entries.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypedDict, Unpack

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeflow.errors import ConfigError
from pipeflow.models import traced
from pipeflow.models.materialise import (InitHook, StateDictFile, copy_buffers, is_meta, materialise, meta_buffers,
                                         skeleton, zero_parameters)
from pipeflow.models.pieces import Adapter, claims, cut, expand, resolve
from pipeflow.models.spec import IGNORE_INDEX, LayerSpec, LossFn, ModelSpec

Source = nn.Module | Callable[[], nn.Module]


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross entropy over the positions whose target is not -100 (masked): logits (..., V),
    targets (...) long -> scalar."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


@dataclass
class _Plan:
    """One layer: its name and the model paths it holds (blocks form), or a traced part."""

    name: str
    paths: list[str]
    adapter: Adapter | None = None
    part: traced.TracedPart | None = None


class _Layers:
    """Builds layer k of the model: cut its pieces from the skeleton (or the module), make them real."""

    def __init__(self, source: Source, root: nn.Module, plans: list[_Plan], init: InitHook | None,
                 init_from: str | None) -> None:
        self.source = source
        self.root = root  # the user's module, or the meta skeleton built from the constructor
        self.plans = plans
        self.init = init
        self.file = StateDictFile(init_from) if init_from else None
        self._buffers: nn.Module | None = None

    def buffer_source(self, needed: list[str], layer: str) -> nn.Module:
        """The model built with real buffers (once), for buffers no reset_parameters recomputes."""
        if self._buffers is None:
            if isinstance(self.source, nn.Module):
                raise ConfigError(
                    f"layer {layer!r}: buffers {needed} were made on the meta device and no reset_parameters "
                    f"recomputes them; pass the model's constructor to from_module instead of a meta module")
            self._buffers = skeleton(self.source, buffers=True)
        return self._buffers

    def build(self, k: int) -> nn.Module:
        """Build layer `k` (called by ModelSpec under the layer's seeded RNG)."""
        plan = self.plans[k]
        if plan.part is not None:
            piece: nn.Module = traced.build_part(self.root, plan.part)
        else:
            piece = cut(self.root, plan.paths, plan.adapter)
        if torch.get_default_device().type == "meta":  # counting parameters: keep it on meta
            return piece
        lost = meta_buffers(piece)
        if self.file is not None:
            zero_parameters(piece, torch.device("cpu"))
            self.file.load_into(piece, plan.name)
            needed = [name for name, persistent, resets in lost if not persistent and not resets]
        else:
            if is_meta(piece) or lost:
                materialise(piece, init=self.init)
            needed = [name for name, _, resets in lost if not resets]
        if needed:
            copy_buffers(piece, self.buffer_source(needed, plan.name), needed)
        return piece


def _blocks_plans(
    root: nn.Module, before: Sequence[str], blocks: str | Sequence[str] | None, after: Sequence[str],
    before_fn: Adapter | None, after_fn: Adapter | None, names: tuple[str, str],
) -> list[_Plan]:
    plans = []
    if before:
        plans.append(_Plan(names[0], list(before), before_fn))
    elif before_fn is not None:
        raise ConfigError("before_fn is given but before=[] names nothing for it to hold")
    for path in [blocks] if isinstance(blocks, str) else list(blocks or []):
        plans += [_Plan(child, [child]) for child in expand(root, path)]
    if after:
        plans.append(_Plan(names[1], list(after), after_fn))
    elif after_fn is not None:
        raise ConfigError("after_fn is given but after=[] names nothing for it to hold")
    return plans


def _sequential_plans(root: nn.Module, groups: Sequence[Sequence[str]] | None) -> list[_Plan]:
    children = list(root._modules)
    if groups is None:
        return [_Plan(name, [name]) for name in children]
    flat = [name for group in groups for name in group]
    if flat != children:
        raise ConfigError(f"groups={[list(g) for g in groups]} must list every child of the nn.Sequential once, "
                          f"in order: {children}")
    return [_Plan("+".join(group), list(group)) for group in groups]


def _check_claims(root: nn.Module, plans: list[_Plan]) -> None:
    """Every path names something, and every parameter and buffer belongs to exactly one layer."""
    for plan in plans:
        for path in plan.paths:
            resolve(root, path)
    keys = [k for k, _ in root.named_parameters(remove_duplicate=False)] + [k for k, _ in root.named_buffers()]
    for key in keys:
        owners = [p.name for p in plans if any(claims(path, key) for path in p.paths)]
        if not owners:
            raise ConfigError(f"{type(root).__name__}.{key} belongs to no layer: add the path of its module (or "
                              f"itself) to before=[...] or after=[...] (model.before / model.after)")
        if len(owners) > 1:
            raise ConfigError(f"{type(root).__name__}.{key} is held by several layers {owners}: each path "
                              f"may be named once")


def _ties(root: nn.Module, plans: list[_Plan]) -> dict[str, list[tuple[str, str]]]:
    """Parameters that several layers hold (by object identity in the model), as ModelSpec ties."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for key, param in root.named_parameters(remove_duplicate=False):
        for plan in plans:
            if any(claims(path, key) for path in plan.paths):
                members = holders.setdefault(id(param), [])
                if plan.name not in [name for name, _ in members]:
                    members.append((plan.name, key))
    return {members[0][1]: members for members in holders.values() if len(members) > 1}


class SpecOptions(TypedDict, total=False):
    """What every form of `from_module` takes beside its split (see :func:`from_module`'s Args)."""

    loss_fn: LossFn
    seed: int
    init: InitHook | None
    init_from: str | None
    name: str | None
    tp_plan: dict[str, str] | None
    ignore_index: int | None
    count_fn: Callable[[Any], int] | None


def from_blocks(
    module: Source,
    blocks: str | Sequence[str] | None,
    *,
    before: Sequence[str] = (),
    after: Sequence[str] = (),
    before_fn: Adapter | None = None,
    after_fn: Adapter | None = None,
    names: tuple[str, str] = ("before", "after"),
    **options: Unpack[SpecOptions],
) -> ModelSpec:
    """The blocks form: prefix modules (`before`, one layer), a loop over the children of the
    `blocks` container(s) (a layer each), suffix modules (`after`, one layer); see
    :func:`from_module` for the arguments."""
    return _blocks_spec(module, _root(module), blocks, before, after, before_fn, after_fn, names, options)


def from_sequential(module: Source, *, groups: Sequence[Sequence[str]] | None = None,
                    **options: Unpack[SpecOptions]) -> ModelSpec:
    """An ``nn.Sequential`` as it is: each child a layer, or `groups` of children by name."""
    return _sequential_spec(module, _root(module), groups, options)


def from_traced(module: Source, split_points: Sequence[str], **options: Unpack[SpecOptions]) -> ModelSpec:
    """The traced form: any forward, split by torch.fx where the submodules `split_points` start
    (in forward order; see `pipeflow.models.traced`)."""
    return _traced_spec(module, _root(module), split_points, options)


def from_module(
    module: Source,
    *,
    before: Sequence[str] = (),
    blocks: str | Sequence[str] | None = None,
    after: Sequence[str] = (),
    before_fn: Adapter | None = None,
    after_fn: Adapter | None = None,
    groups: Sequence[Sequence[str]] | None = None,
    split_points: Sequence[str] | None = None,
    names: tuple[str, str] = ("before", "after"),
    **options: Unpack[SpecOptions],
) -> ModelSpec:
    """Describe an existing ``nn.Module`` as pipeline layers, in the form its arguments name:
    :func:`from_blocks` (`before`/`blocks`/`after`), :func:`from_traced` (`split_points`) or
    :func:`from_sequential` (an ``nn.Sequential``, `groups`).  See the module docstring.

    Args:
        module: a constructor of the whole model (each rank then materialises only its own
            layers), a module built on the ``meta`` device, or a built module (its weights used).
        before: blocks form: paths of the modules / parameters run before the blocks (one layer).
        blocks: blocks form: path(s) of containers (ModuleList, Sequential) whose children are
            the blocks, one layer each, called in order: ``x = block(x)``.
        after: blocks form: paths of what runs after the blocks (one layer).
        before_fn: ``fn(piece, *inputs)``: the prefix's forward when it is more than calling
            `before` in order; `piece` has the model's attribute names (``piece.tok_emb``).
        after_fn: the same for the suffix (``lambda m, x: m.fc(torch.flatten(m.avgpool(x), 1))``).
        groups: nn.Sequential form: children grouped into layers by name (default: one each).
        split_points: traced form: the submodules that start a new layer, in forward order.
        names: the names of the `before` and `after` layers.
        options: every form's (:class:`SpecOptions`):
            ``loss_fn``: (output, targets) -> mean loss; default cross entropy over the last dimension.
            ``seed``: layer i is initialised under a RNG seeded from (seed, i).
            ``init``: ``init(name, module)`` for each submodule of a layer being built from a
            constructor, after each module's own ``reset_parameters``: initialisation the model's
            constructor does beyond its modules' own (GPT-2's scaled init by name, zero-init heads).
            ``init_from``: a state dict file of the unsplit model (``torch.save(model.state_dict(),
            f)``) to load instead; each rank reads only its own layers' tensors.
            ``name``: the model's name (default: its class name).
            ``tp_plan``: how ``parallel.tp`` splits the layers: ``{glob of submodule paths: style}``
            (the paths as the model names them, e.g. ``{"blocks.*.attn.qkv": "colwise_qkv",
            "blocks.*.attn.proj": "rowwise"}``; styles: ``pipeflow.models.spec.TP_STYLES``),
            matched in every layer; None: the model cannot run with tp > 1.
            ``ignore_index``: the target value `loss_fn` ignores (cross entropy's -100): a
            micro-batch weighs by the targets its loss counts; None: every target counts.
            ``count_fn``: ``count_fn(targets) -> int``, how many targets `loss_fn` averages over,
            for a loss that counts otherwise; None: `ignore_index` decides (``ModelSpec.loss_count``).

    Returns:
        A ModelSpec whose layers hold the model's own modules under their own paths (state dict
        keys unchanged, so its ``export_name`` is the identity), tied where the model shares a
        parameter between layers.

    Raises:
        ConfigError: no form is given (or two are), a path names nothing, a parameter belongs to
            no layer; UntraceableModelError: the traced form met code it cannot trace.
    """
    root = _root(module)
    blocks_form = bool(before or blocks or after)
    if blocks_form and split_points:
        raise ConfigError("give either the blocks form (before/blocks/after) or split_points (traced), not both")
    if groups is not None and not isinstance(root, nn.Sequential) and (split_points or blocks_form):
        raise ConfigError("groups applies to an nn.Sequential only")
    if split_points:
        return _traced_spec(module, root, split_points, options)
    if blocks_form:
        return _blocks_spec(module, root, blocks, before, after, before_fn, after_fn, names, options)
    if not isinstance(root, nn.Sequential):
        raise ConfigError(f"say how to split {type(root).__name__}: before=[...], blocks='<ModuleList path>', "
                          f"after=[...] (a loop over blocks), or split_points=[...] (traced); only an "
                          f"nn.Sequential splits by itself")
    return _sequential_spec(module, root, groups, options)


def _blocks_spec(module: Source, root: nn.Module, blocks: str | Sequence[str] | None, before: Sequence[str],
                 after: Sequence[str], before_fn: Adapter | None, after_fn: Adapter | None, names: tuple[str, str],
                 options: SpecOptions) -> ModelSpec:
    plans = _blocks_plans(root, before, blocks, after, before_fn, after_fn, names)
    _check_claims(root, plans)
    return _spec(module, root, plans, **options)


def _sequential_spec(module: Source, root: nn.Module, groups: Sequence[Sequence[str]] | None,
                     options: SpecOptions) -> ModelSpec:
    if not isinstance(root, nn.Sequential):
        raise ConfigError(f"from_sequential needs an nn.Sequential; got {type(root).__name__} (say how to split it: "
                          f"from_blocks or from_traced)")
    return _spec(module, root, _sequential_plans(root, groups), **options)


def _traced_spec(module: Source, root: nn.Module, split_points: Sequence[str], options: SpecOptions) -> ModelSpec:
    parts = traced.split_graph(traced.trace(root), split_points, [f"part{k}" for k in range(len(split_points) + 1)])
    return _spec(module, root, [_Plan(p.name, p.paths, part=p) for p in parts], **options)


def _root(module: Source) -> nn.Module:
    """The module to split: `module`, or its skeleton on the meta device when it is a constructor."""
    root = skeleton(module) if callable(module) and not isinstance(module, nn.Module) else module
    if not isinstance(root, nn.Module):
        raise ConfigError(f"from_module needs an nn.Module or a constructor of one; got {type(module).__name__}")
    return root


def _spec(module: Source, root: nn.Module, plans: list[_Plan], loss_fn: LossFn = cross_entropy, seed: int = 0,
          init: InitHook | None = None, init_from: str | None = None, name: str | None = None,
          tp_plan: dict[str, str] | None = None, ignore_index: int | None = IGNORE_INDEX,
          count_fn: Callable[[Any], int] | None = None) -> ModelSpec:
    """The ModelSpec of `root` split by `plans` (layers built from `module`)."""
    layers = _Layers(module, root, plans, init, init_from)
    specs = [LayerSpec(plan.name, layers.build, (k,)) for k, plan in enumerate(plans)]
    # export_name: the layers' keys are the module's own (checkpoint export writes them as they are)
    return ModelSpec(name or type(root).__name__.lower(), specs, loss_fn=loss_fn, seed=seed, tied=_ties(root, plans),
                     export_name=original_name, tp_plan=dict(tp_plan) if tp_plan else None,
                     ignore_index=ignore_index, count_fn=count_fn)


def original_name(index: int, key: str) -> str:
    """The original module's state-dict name of layer `index`'s entry `key`: the key itself, in
    every form (a piece or a traced part holds the module's parts under their own paths)."""
    return key


def build_module(
    module: Any = None,
    before: Any = None,
    blocks: Any = None,
    after: Any = None,
    split_points: Any = None,
    before_fn: Any = None,
    after_fn: Any = None,
    loss_fn: Any = None,
    init: Any = None,
    init_from: str | None = None,
    seed: int = 0,
    tp_plan: Any = None,
    ignore_index: int | None = IGNORE_INDEX,
    count_fn: Any = None,
) -> ModelSpec:
    """A user's own nn.Module from the config (``model=module``): `from_module` with its keys.

    ``model.module._target_=<constructor>`` names the model's class or builder (the group sets
    ``_partial_: true``, so Hydra hands over a constructor and the model is built on meta);
    its arguments go beside it (``+model.module.n_layer=4``). Adapters, the loss and the init
    hook are given the same way (``model.before_fn={_target_: pkg.fn, _partial_: true}``).

    Args:
        module: the constructor (Hydra: a partial of ``model.module._target_``).
        before, blocks, after: the blocks form's paths (`from_module`).
        split_points: the traced form's split points.
        before_fn, after_fn: the blocks form's adapters.
        loss_fn: (output, targets) -> loss; default cross entropy over the last dimension.
        init: the per-layer init hook.
        init_from: a state dict file of the unsplit model.
        seed: the model seed.
        tp_plan: ``parallel.tp``'s plan, ``{glob of submodule paths: style}``
            (``model.tp_plan={'blocks.*.mlp.fc1': colwise, 'blocks.*.mlp.fc2': rowwise}``).
        ignore_index, count_fn: how the loss counts its targets (`from_module`;
            ``model.count_fn={_target_: pkg.count, _partial_: true}``).

    Raises:
        ConfigError: model.module is not set.
    """
    if module is None:
        raise ConfigError("model=module needs model.module._target_=<your model's class or constructor>")
    return from_module(
        module, before=list(before or []), blocks=blocks if isinstance(blocks, (str, type(None))) else list(blocks),
        after=list(after or []), split_points=list(split_points) if split_points else None,
        before_fn=before_fn, after_fn=after_fn, loss_fn=loss_fn or cross_entropy, init=init, init_from=init_from,
        seed=seed, tp_plan=dict(tp_plan) if tp_plan else None, ignore_index=ignore_index, count_fn=count_fn)
