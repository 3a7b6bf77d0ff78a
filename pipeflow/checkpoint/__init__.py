"""Checkpoints: saved atomically under any layout and loaded under any other (:mod:`.save`,
:mod:`.load`, :mod:`.names`), found (:mod:`.find`), written in the background
(:mod:`.background`), each host's part kept or gathered (:mod:`.storage`, :mod:`.replicas`,
:mod:`.gather`), checked (:mod:`.integrity`), pruned (:mod:`.retention`), exported as the model's
own weights (:mod:`.export`), and the run directory's lock every save checks (:mod:`.lock`).

``from pipeflow.checkpoint import save, load, find_latest, export`` gives the API; ``python -m
pipeflow.checkpoint`` the command."""
from __future__ import annotations

from typing import Any

__all__ = [
    "ADAM_FIELDS", "LATEST", "META", "SafeReader", "candidates", "checkpoints_of", "choose", "export", "find_latest",
    "is_checkpoint", "load", "main", "model_state", "optimizer_state", "param_names", "read_meta", "remove_leftovers",
    "resolve", "save", "saved_layout", "saved_rank", "verify", "whole_strided",
]


def __getattr__(name: str) -> Any:
    """The API's names, imported on first use so that ``pipeflow.checkpoint.find`` alone stays light."""
    if name in __all__:
        from pipeflow.checkpoint import saving as api
        return getattr(api, name)
    raise AttributeError(f"module 'pipeflow.checkpoint' has no attribute {name!r}")
