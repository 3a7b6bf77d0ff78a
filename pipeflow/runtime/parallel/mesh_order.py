"""Where each global rank sits in the dp x pp x cp x tp mesh: ``parallel.order``.

The order lists the mesh's dimensions outermost first; the innermost one varies fastest along
the global ranks, so its groups are consecutive ranks, the GPUs of one host.  pipeflow's
order of old is ``[dp, pp, tp]``: tp innermost (its per-layer collectives on the fastest links),
then the pipeline (a pipeline's ranks consecutive, only the once-per-step dp all-reduce crossing
hosts).  Megatron, torchtitan and DeepSpeed put pp outermost instead (``[pp, dp, tp]``): a large
model's gradient all-reduce moves far more bytes per step than a pipeline boundary, so the dp
groups take the fast links and the boundaries cross hosts.  Context parallelism (``parallel.cp``)
passes key/value blocks round its ring in every attention layer, so an order that does not name
cp puts it just outside tp (Megatron's tp-cp-...); ``[pp,dp,cp,tp]`` names it.  No torch here:
the coordinates are arithmetic, shared by the mesh builder, the reports and the planner.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeflow.errors import ConfigError

DIMS = ("dp", "pp", "tp")  # what every order names; cp where it is to sit elsewhere than just outside tp
DEFAULT_ORDER: tuple[str, ...] = ("dp", "pp", "tp")
AUTO = "auto"


def parse_order(value: Any) -> tuple[str, ...] | None:
    """``parallel.order`` as a tuple of dimension names (outermost first), or None for ``auto``.

    Accepts a list (``[pp,dp,tp]``) or a string (``pp,dp,tp``); every dimension is named once,
    tp too where it is 1, so an order means one thing whatever the degrees; cp may be named too.

    Raises:
        ConfigError: not a permutation of dp, pp, tp (and optionally cp), or ``auto``.
    """
    if value is None or (isinstance(value, str) and value.strip() == AUTO):
        return None
    items = value.strip("[] ").split(",") if isinstance(value, str) else list(value)
    order = tuple(str(item).strip() for item in items)
    if sorted(d for d in order if d != "cp") != sorted(DIMS) or order.count("cp") > 1:
        raise ConfigError(f"parallel.order={value!r} is not an order of the mesh's dimensions: give each of dp, pp "
                          f"and tp once (and cp, where it is not to sit just outside tp), outermost first (e.g. "
                          f"parallel.order=[pp,dp,tp]), or parallel.order=auto")
    return order


def with_cp(order: Sequence[str]) -> tuple[str, ...]:
    """`order` naming cp: where it names it, as it is; else cp just outside tp."""
    if "cp" in order:
        return tuple(order)
    at = list(order).index("tp")
    return (*order[:at], "cp", *order[at:])


def order_text(order: Sequence[str]) -> str:
    """``[pp,dp,tp]``, as the override is written."""
    return "[" + ",".join(order) + "]"


@dataclass(frozen=True)
class MeshGrid:
    """The mesh's shape and order: every global rank's (dp, pp, tp) coordinates (and cp
    coordinate) and back.

    Attributes:
        dp, pp, tp: the degrees.
        order: the dimensions outermost first (a permutation of :data:`DIMS`, cp named or not).
        cp: the context-parallel degree (its place: :func:`with_cp`).
    """

    dp: int
    pp: int
    tp: int = 1
    order: tuple[str, ...] = DEFAULT_ORDER
    cp: int = 1

    @property
    def size(self) -> int:
        """The ranks of the mesh."""
        return self.dp * self.pp * self.tp * self.cp

    def _sizes(self) -> dict[str, int]:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp, "cp": self.cp}

    def _place(self, rank: int) -> dict[str, int]:
        sizes, place = self._sizes(), {}
        for dim in reversed(with_cp(self.order)):  # innermost varies fastest
            rank, place[dim] = divmod(rank, sizes[dim])
        return place

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """Global rank -> its (dp, pp, tp) coordinates."""
        place = self._place(rank)
        return place["dp"], place["pp"], place["tp"]

    def cp_rank(self, rank: int) -> int:
        """Global rank -> its cp coordinate."""
        return self._place(rank)["cp"]

    def rank(self, d: int, r: int, t: int = 0, c: int = 0) -> int:
        """(dp, pp, tp[, cp]) coordinates -> the global rank."""
        sizes, place, rank = self._sizes(), {"dp": d, "pp": r, "tp": t, "cp": c}, 0
        for dim in with_cp(self.order):
            rank = rank * sizes[dim] + place[dim]
        return rank

    def pipelines(self) -> list[list[int]]:
        """The global ranks of every pipeline, pipeline rank by pipeline rank, one per (dp, cp,
        tp) coordinate in the order k = (d * cp + c) * tp + t."""
        return [[self.rank(d, r, t, c) for r in range(self.pp)]
                for d in range(self.dp) for c in range(self.cp) for t in range(self.tp)]

    def dp_groups(self) -> list[list[int]]:
        """The global ranks of every data-parallel group (one per (pp, cp, tp) coordinate)."""
        return [[self.rank(d, r, t, c) for d in range(self.dp)]
                for r in range(self.pp) for c in range(self.cp) for t in range(self.tp)]

    def tp_groups(self) -> list[list[int]]:
        """The global ranks of every tensor-parallel group (one per (dp, cp, pp) coordinate)."""
        return [[self.rank(d, r, t, c) for t in range(self.tp)]
                for d in range(self.dp) for c in range(self.cp) for r in range(self.pp)]

    def cp_groups(self) -> list[list[int]]:
        """The global ranks of every context-parallel group (one per (dp, pp, tp) coordinate), in
        cp order: each ring."""
        return [[self.rank(d, r, t, c) for c in range(self.cp)]
                for d in range(self.dp) for r in range(self.pp) for t in range(self.tp)]

    def replica_groups(self) -> list[list[int]]:
        """The ranks holding the same parameters (one group per (pp, tp) coordinate, over dp x
        cp): the gradient reduction's groups."""
        return [[self.rank(d, r, t, c) for d in range(self.dp) for c in range(self.cp)]
                for r in range(self.pp) for t in range(self.tp)]

    def rank_table(self) -> list[list[list[int]]]:
        """``table[d][r][t]``: the global rank at each coordinate (torch's DeviceMesh takes it);
        with cp, ``table[d][c][r][t]``."""
        if self.cp > 1:
            return [[[[self.rank(d, r, t, c) for t in range(self.tp)] for r in range(self.pp)]
                     for c in range(self.cp)] for d in range(self.dp)]  # type: ignore[return-value]
        return [[[self.rank(d, r, t) for t in range(self.tp)] for r in range(self.pp)] for d in range(self.dp)]

    def label(self, rank: int) -> str:
        """``rank 5 (dp 1, pp 0, tp 1)`` with tensor or context parallelism (cp too), else
        ``rank 5 (pipeline rank 1)``."""
        d, r, t = self.coordinates(rank)
        if self.cp > 1:
            return f"rank {rank} (dp {d}, pp {r}, cp {self.cp_rank(rank)}, tp {t})"
        return f"rank {rank} (dp {d}, pp {r}, tp {t})" if self.tp > 1 else f"rank {rank} (pipeline rank {r})"

    def describe(self) -> str:
        """``mesh order [pp,dp,tp]: pipeline ranks [0, 2] [1, 3]`` (the first 8 pipelines)."""
        pipes = self.pipelines()
        listed = " ".join(str(p) for p in pipes[:8]) + (f" ... ({len(pipes)} pipelines)" if len(pipes) > 8 else "")
        order = with_cp(self.order) if self.cp > 1 else self.order
        return f"mesh order {order_text(order)}: pipeline ranks {listed}"
