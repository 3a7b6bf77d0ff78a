"""What ``parallel.ep`` changes in a layer's profile: each rank holds 1/ep of the routed experts.

The profile is taken on one process with every expert (the tokens' compute is the same either
way: each token still runs its top_k experts, somewhere), so a stage's parameter, gradient and
optimizer bytes shrink by the experts that moved to the other ep ranks.  The all_to_all's time and
bytes are not modelled yet.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from pipeflow.models.spec import ModelSpec
from pipeflow.planning.profile import LayerProfile


def expert_parameter_counts(spec: ModelSpec) -> list[int]:
    """Each layer's routed-expert parameters (names with ``.experts.``), built one layer at a time
    on the meta device."""
    counts = []
    for index in range(len(spec)):
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            layer = spec.layers[index].build()
        counts.append(sum(p.numel() for name, p in layer.named_parameters() if ".experts." in f".{name}"))
    return counts


def split_expert_profiles(profiles: Sequence[LayerProfile], expert_params: Sequence[int], ep: int) -> list[LayerProfile]:
    """The profiles as one ep rank holds the layers: ``expert_params[i] (1 - 1/ep)`` parameters fewer."""
    out = []
    for profile, experts in zip(profiles, expert_params):
        gone = experts - experts // ep
        if not gone or not profile.params:
            out.append(profile)
            continue
        kept = profile.params - gone
        out.append(dataclasses.replace(profile, params=kept, param_bytes=round(profile.param_bytes * kept / profile.params)))
    return out
