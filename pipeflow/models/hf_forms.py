"""Which Hugging Face decoders ``model=hf`` cuts: the *form* of their forwards.

``model=hf`` calls a family's own decoder layers and recomputes, on each stage, what the family's
base model computes around them (the embedding, the rotary ``(cos, sin)``, the causal or
sliding-window mask, the final norm) and what its ``*ForCausalLM`` does after (``lm_head``, a logit
soft-cap).  That is exact for a family when both forwards are, statement for statement, ones it
was tested against: so a family is taken by the form of those forwards — their source without
docstring, decorators, signature or annotations — compared with those of the families in
:data:`TESTED` (each tested in float64 against transformers).  Most
families transformers generates from its modular files share a tested family's forwards (Seed-OSS
and Youtu Llama's, VaultGemma Gemma 2's, PhiMoE Mixtral's, GLM-4-MoE-Lite OLMoE's ...).

A family is refused by name with its reason: no ``*ForCausalLM``, a multimodal config, layers
with a state of their own (linear attention, state-space mixers), a layout other than
``embed_tokens`` / ``layers`` / ``norm``, or a forward that does something else around its layers
(the first such statement is quoted).
"""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any

from pipeflow.errors import ConfigError

# model_type -> (the modeling module under transformers.models, the *ForCausalLM class name): the
# tested families, whose base model only embeds, runs its decoder layers (rotary and masks from the
# positions, sliding windows by layer_types or Mistral's sliding_window) and norms, with no
# scaling, dropout or state outside the layers (read in their forward), each tested in float64
# against transformers (tests/test_hf.py); others are taken by the form of their forwards
TESTED = {
    "llama": ("llama.modeling_llama", "LlamaForCausalLM"),
    "mistral": ("mistral.modeling_mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2.modeling_qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3.modeling_qwen3", "Qwen3ForCausalLM"),
    "olmo": ("olmo.modeling_olmo", "OlmoForCausalLM"),
    "olmo2": ("olmo2.modeling_olmo2", "Olmo2ForCausalLM"),
    "stablelm": ("stablelm.modeling_stablelm", "StableLmForCausalLM"),
    "helium": ("helium.modeling_helium", "HeliumForCausalLM"),
    "exaone4": ("exaone4.modeling_exaone4", "Exaone4ForCausalLM"),
    "arcee": ("arcee.modeling_arcee", "ArceeForCausalLM"),
    "ministral": ("ministral.modeling_ministral", "MinistralForCausalLM"),
    "apertus": ("apertus.modeling_apertus", "ApertusForCausalLM"),
    # the embedding scaled inside its module, logits soft-capped in the head, Gemma 3's rotary per layer type
    "gemma": ("gemma.modeling_gemma", "GemmaForCausalLM"),
    "gemma2": ("gemma2.modeling_gemma2", "Gemma2ForCausalLM"),
    "gemma3_text": ("gemma3.modeling_gemma3", "Gemma3ForCausalLM"),
    "phi3": ("phi3.modeling_phi3", "Phi3ForCausalLM"),
    "smollm3": ("smollm3.modeling_smollm3", "SmolLM3ForCausalLM"),
    "glm": ("glm.modeling_glm", "GlmForCausalLM"),
    "glm4": ("glm4.modeling_glm4", "Glm4ForCausalLM"),
    "hunyuan_v1_dense": ("hunyuan_v1_dense.modeling_hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM"),
    "ernie4_5": ("ernie4_5.modeling_ernie4_5", "Ernie4_5ForCausalLM"),
    # mixtures of experts: the fused expert weights loaded through transformers' conversion mapping
    "mixtral": ("mixtral.modeling_mixtral", "MixtralForCausalLM"),
    "qwen2_moe": ("qwen2_moe.modeling_qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("qwen3_moe.modeling_qwen3_moe", "Qwen3MoeForCausalLM"),
    "olmoe": ("olmoe.modeling_olmoe", "OlmoeForCausalLM"),
    "deepseek_v3": ("deepseek_v3.modeling_deepseek_v3", "DeepseekV3ForCausalLM"),
    "gpt_oss": ("gpt_oss.modeling_gpt_oss", "GptOssForCausalLM"),
    "glm4_moe": ("glm4_moe.modeling_glm4_moe", "Glm4MoeForCausalLM"),
    "deepseek_v2": ("deepseek_v2.modeling_deepseek_v2", "DeepseekV2ForCausalLM"),
    "ernie4_5_moe": ("ernie4_5_moe.modeling_ernie4_5_moe", "Ernie4_5_MoeForCausalLM"),
    "hunyuan_v1_moe": ("hunyuan_v1_moe.modeling_hunyuan_v1_moe", "HunYuanMoEV1ForCausalLM"),
    "dots1": ("dots1.modeling_dots1", "Dots1ForCausalLM"),
    "flex_olmo": ("flex_olmo.modeling_flex_olmo", "FlexOlmoForCausalLM"),
}
# one tested family per distinct form, in TESTED (tests/test_hf.py checks they cover every tested family)
BASE_FORMS = ("llama", "mistral", "qwen2", "stablelm", "exaone4", "ministral", "gemma", "gemma2", "gemma3_text",
              "mixtral", "qwen2_moe", "olmoe", "dots1", "gpt_oss")
HEAD_FORMS = ("llama", "stablelm", "gemma2", "mixtral", "deepseek_v3")
# a base model that makes every layer's mask slide once config.sliding_window is set (not by layer_types)
WINDOW_STATEMENT = ("mask_function = create_causal_mask if self.config.sliding_window is None else "
                    "create_sliding_window_causal_mask")
ATTENTION_KINDS = {"full_attention", "sliding_attention"}  # layer_types whose layers keep no state of their own
LAYOUT = ("embed_tokens", "layers", "norm")  # the base model's cut: its pipeline plan
MULTIMODAL = {"text", "vision", "audio", "vq", "encoder", "decoder"}  # sub-config name prefixes of multimodal models


@dataclass(frozen=True)
class Family:
    """A ``*ForCausalLM`` class model=hf cuts.

    Attributes:
        model_type: the config's ``model_type``.
        cls: the ``*ForCausalLM`` class.
        tested: whether it is one of the tested families (else taken by its forwards' form).
        window_mask: whether its mask slides on every layer once ``config.sliding_window`` is set
            (Mistral's, Mixtral's, Phi-3's, Qwen3-MoE's forward); else by ``config.layer_types``.
    """

    model_type: str
    cls: type
    tested: bool
    window_mask: bool


def forward_form(function: Any) -> str:
    """`function`'s body as source, without docstring, decorators, signature or annotations."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
    body = list(getattr(tree, "body", []))
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.AnnAssign):
            node.annotation = ast.Name("_", ast.Load())
    return "\n".join(ast.unparse(statement) for statement in body)


def causal_lm_classes() -> dict[str, str]:
    """model_type -> the ``*ForCausalLM`` class name transformers maps it to."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@functools.cache
def _classes(model_type: str) -> tuple[type, type]:
    """(the ``*ForCausalLM`` class, its base model class) of `model_type`."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module_name, class_name = TESTED.get(model_type) or (model_type_to_module_name(model_type),
                                                            causal_lm_classes()[model_type])
    module = importlib.import_module(f"transformers.models.{module_name}")  # a package exports its classes
    cls = getattr(module, class_name)
    base = getattr(module, class_name.replace("ForCausalLM", "Model"), None)
    return cls, base


@functools.cache
def _form(model_type: str, which: str) -> str:
    cls, base = _classes(model_type)
    return forward_form((base if which == "base" else cls).forward)


def _first_difference(form: str, known: list[str]) -> str:
    """The first statement of `form` that the nearest of the `known` forms lacks."""
    mine = form.splitlines()
    nearest = max(known, key=lambda k: len(set(mine) & set(k.splitlines())))
    theirs = set(nearest.splitlines())
    return next((line.strip() for line in mine if line not in theirs), mine[0].strip() if mine else "")


def family(config: Any, path: str | None = None) -> Family:
    """The family of `config` (a Hugging Face config) that model=hf cuts.

    Raises:
        ConfigError: transformers has no ``*ForCausalLM`` for it, or it is refused (the reason named).
    """
    model_type = config.model_type
    if model_type in TESTED:  # (asked once per decoder layer: no mapping read, the forms cached)
        return Family(model_type, _classes(model_type)[0], True, _window_mask(model_type))
    classes = causal_lm_classes()
    if model_type not in classes:
        where = f" ({path}/config.json)" if path else ""
        raise ConfigError(f"model=hf does not support model_type {model_type!r}{where}: transformers has no "
                          f"*ForCausalLM for it; model=hf trains text decoders")
    name = f"{classes[model_type]} (model_type {model_type!r})"

    def refuse(reason: str) -> ConfigError:
        return ConfigError(f"model=hf does not support {name}: {reason}; it cuts text decoders whose base model only "
                           f"embeds, runs its decoder layers and norms (docs/reference/hf-families.md)")

    towers = sorted(k for k in getattr(config, "sub_configs", None) or {} if k.split("_")[0] in MULTIMODAL)
    if towers:
        raise refuse(f"a multimodal config (sub-configs {towers}): save its language model as a *ForCausalLM "
                     f"folder and train that")
    kinds = sorted(set(getattr(config, "layer_types", None) or ()) - ATTENTION_KINDS)
    if kinds:
        raise refuse(f"its {', '.join(kinds)} layers keep a state of their own (a recurrent cache) that no "
                     f"tensor crossing a stage boundary carries")
    cls, base = _classes(model_type)
    plan = getattr(config, "base_model_pp_plan", None) or {}
    if base is None or (plan and set(plan) != set(LAYOUT)):
        raise refuse(f"its base model is not cut as {' / '.join(LAYOUT)} (base_model_pp_plan: "
                     f"{sorted(plan) or 'none'})")
    for which, tested, what in (("base", BASE_FORMS, f"{base.__name__}.forward"),
                                ("head", HEAD_FORMS, f"{cls.__name__}.forward")):
        known = [_form(k, which) for k in tested]
        form = _form(model_type, which)
        if form not in known:
            raise refuse(f"{what} computes outside its layers what a stage would not recompute "
                         f"(`{_first_difference(form, known)[:120]}`)")
    return Family(model_type, cls, False, _window_mask(model_type))


def tested_forms(model_type: str) -> tuple[str, str]:
    """The tested families whose base model's and head's forwards `model_type`'s are ("" where none)."""
    return tuple(next((k for k in forms if _form(k, which) == _form(model_type, which)), "")  # type: ignore[return-value]
                 for which, forms in (("base", BASE_FORMS), ("head", HEAD_FORMS)))


def _window_mask(model_type: str) -> bool:
    """Whether `model_type`'s base model makes every layer's mask slide once ``config.sliding_window``
    is set (:data:`WINDOW_STATEMENT`)."""
    return WINDOW_STATEMENT in (line.strip() for line in _form(model_type, "base").splitlines())


def families_by_form() -> list[str]:
    """The model_types transformers has a ``*ForCausalLM`` for that model=hf takes by form (not
    among the tested families)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    taken = []
    for model_type in sorted(causal_lm_classes()):
        if model_type in TESTED or model_type not in CONFIG_MAPPING:
            continue
        try:
            config = CONFIG_MAPPING[model_type]()
            family(config)
        except Exception:  # refused, or a module that does not import here
            continue
        taken.append(model_type)
    return taken
