"""The closed sets of words some config keys take (``comm.shapes=per_step``): Enums that Hydra
checks while composing, naming the allowed words, and that compare equal to their word."""
from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """A config key's closed set of words (``comm.shapes=per_step``): compares equal to its word,
    prints as it, and Hydra refuses any other word naming the allowed ones."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class ShapeMode(Choice):
    """``comm.shapes``: how often the stages learn the shapes of what they receive."""

    static = "static"
    per_step = "per_step"
    per_microbatch = "per_microbatch"


class Placement(Choice):
    """``schedule.placement``: which stages a rank holds (loop: r, r+p, ...; v: r and 2p-1-r)."""

    loop = "loop"
    v = "v"


class RecvPosting(Choice):
    """``comm.post_recvs`` (gloo): when a step's recvs are posted."""

    ahead = "ahead"
    at_step = "at_step"
    auto = "auto"
