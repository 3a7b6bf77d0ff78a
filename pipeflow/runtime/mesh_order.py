"""Where each global rank sits in the dp x pp x tp mesh: ``parallel.order``.

The order lists the mesh's dimensions outermost first; the innermost one varies fastest along
the global ranks, so its groups are consecutive ranks, the GPUs of one host.  pipeflow's
order of old is ``[dp, pp, tp]``: tp innermost (its per-layer collectives on the fastest links),
then the pipeline (a pipeline's ranks consecutive, only the once-per-step dp all-reduce crossing
hosts).  Megatron, torchtitan and DeepSpeed put pp outermost instead (``[pp, dp, tp]``): a large
model's gradient all-reduce moves far more bytes per step than a pipeline boundary, so the dp
groups take the fast links and the boundaries cross hosts.  No torch here: the coordinates are
arithmetic, shared by the mesh builder, the reports and the planner.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeflow.errors import ConfigError

DIMS = ("dp", "pp", "tp")
DEFAULT_ORDER: tuple[str, ...] = ("dp", "pp", "tp")
AUTO = "auto"


def parse_order(value: Any) -> tuple[str, ...] | None:
    """``parallel.order`` as a tuple of dimension names (outermost first), or None for ``auto``.

    Accepts a list (``[pp,dp,tp]``) or a string (``pp,dp,tp``); every dimension is named once,
    tp too where it is 1, so an order means one thing whatever the degrees.

    Raises:
        ConfigError: not a permutation of dp, pp, tp (or ``auto``).
    """
    if value is None or (isinstance(value, str) and value.strip() == AUTO):
        return None
    items = value.strip("[] ").split(",") if isinstance(value, str) else list(value)
    order = tuple(str(item).strip() for item in items)
    if sorted(order) != sorted(DIMS):
        raise ConfigError(f"parallel.order={value!r} is not an order of the mesh's dimensions: give each of dp, pp "
                          f"and tp once, outermost first (e.g. parallel.order=[pp,dp,tp]), or parallel.order=auto")
    return order


def order_text(order: Sequence[str]) -> str:
    """``[pp,dp,tp]``, as the override is written."""
    return "[" + ",".join(order) + "]"


@dataclass(frozen=True)
class MeshGrid:
    """The mesh's shape and order: every global rank's (dp, pp, tp) coordinates and back.

    Attributes:
        dp, pp, tp: the degrees.
        order: the dimensions outermost first (a permutation of :data:`DIMS`).
    """

    dp: int
    pp: int
    tp: int = 1
    order: tuple[str, ...] = DEFAULT_ORDER

    @property
    def size(self) -> int:
        """The ranks of the mesh."""
        return self.dp * self.pp * self.tp

    def _sizes(self) -> dict[str, int]:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp}

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """Global rank -> its (dp, pp, tp) coordinates."""
        sizes, place = self._sizes(), {}
        for dim in reversed(self.order):  # innermost varies fastest
            rank, place[dim] = divmod(rank, sizes[dim])
        return place["dp"], place["pp"], place["tp"]

    def rank(self, d: int, r: int, t: int = 0) -> int:
        """(dp, pp, tp) coordinates -> the global rank."""
        sizes, place, rank = self._sizes(), {"dp": d, "pp": r, "tp": t}, 0
        for dim in self.order:
            rank = rank * sizes[dim] + place[dim]
        return rank

    def pipelines(self) -> list[list[int]]:
        """The global ranks of every pipeline, pipeline rank by pipeline rank, one per (dp, tp)
        pair in the order k = d * tp + t."""
        return [[self.rank(d, r, t) for r in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def dp_groups(self) -> list[list[int]]:
        """The global ranks of every data-parallel group (one per (pp, tp) pair)."""
        return [[self.rank(d, r, t) for d in range(self.dp)] for r in range(self.pp) for t in range(self.tp)]

    def tp_groups(self) -> list[list[int]]:
        """The global ranks of every tensor-parallel group (one per (dp, pp) pair)."""
        return [[self.rank(d, r, t) for t in range(self.tp)] for d in range(self.dp) for r in range(self.pp)]

    def rank_table(self) -> list[list[list[int]]]:
        """``table[d][r][t]``: the global rank at each coordinate (torch's DeviceMesh takes it)."""
        return [[[self.rank(d, r, t) for t in range(self.tp)] for r in range(self.pp)] for d in range(self.dp)]

    def label(self, rank: int) -> str:
        """``rank 5 (dp 1, pp 0, tp 1)`` with tensor parallelism, else ``rank 5 (pipeline rank 1)``."""
        d, r, t = self.coordinates(rank)
        return f"rank {rank} (dp {d}, pp {r}, tp {t})" if self.tp > 1 else f"rank {rank} (pipeline rank {r})"

    def describe(self) -> str:
        """``mesh order [pp,dp,tp]: pipeline ranks [0, 2] [1, 3]`` (the first 8 pipelines)."""
        pipes = self.pipelines()
        listed = " ".join(str(p) for p in pipes[:8]) + (f" ... ({len(pipes)} pipelines)" if len(pipes) > 8 else "")
        return f"mesh order {order_text(self.order)}: pipeline ranks {listed}"
