"""Timeline pictures: one row per rank, F / B / W boxes in their colours, idle time left white.

Draws simulated schedules (``python -m pipeflow.schedules.show``) and measured steps
(``pipeflow.observability.trace``) alike.  matplotlib is imported on the first drawing, so
importing this module costs nothing.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeflow.schedules.ir import Action

Timeline = Sequence[tuple[int, Action, float, float]]  # (rank, action, start, end)
_CMAPS = {"F": "Blues", "B": "Oranges", "W": "Greens"}
_NAMES = {"F": "F forward", "B": "B backward", "W": "W weight grads"}
_SHARD_COLOUR = "tab:purple"
_COPY_COLOURS = {"d2h": "tab:red", "h2d": "tab:cyan"}


def chunk_colour(kind: str, chunk: int) -> tuple[float, float, float, float]:
    """The fill of a `kind` box on a rank's `chunk`-th stage: darker for earlier chunks."""
    import matplotlib

    return matplotlib.colormaps[_CMAPS[kind]](max(0.2, 0.6 - 0.2 * chunk))


def draw_timeline(
    timeline: Timeline,
    num_ranks: int,
    title: str,
    out_path: str | Path,
    waits: Sequence[tuple[int, float, float]] = (),
    xlabel: str = "time",
    unit: float = 1.0,
    shards: Sequence[tuple[int, float, float]] = (),
    copies: Sequence[tuple[int, str, float, float]] = (),
) -> Path:
    """Draw a timeline of compute actions (simulated or measured) to an image file.

    Args:
        timeline: ``(rank, action, start, end)`` per action, as in ``SimResult.timeline``.
        num_ranks: p, the rows drawn (rank 0 on top).
        title: the picture's title.
        out_path: where to write (format from the suffix, e.g. ``.png``, ``.svg``).
        waits: ``(rank, start, end)`` of communication calls, drawn as thin grey bars
            (a measured timeline, see ``pipeflow.observability.trace``).
        xlabel: the unit of the time axis.
        unit: the time of a typical action; the figure is as wide as the span in such units
            (1 for unit costs; a measured timeline passes its median action time).
        shards: ``(rank, start, end)`` of the gathers and reductions of sharded stages
            (``parallel.shard=full``), drawn as thin purple bars.
        copies: ``(rank, kind, start, end)`` of activation copies (``pipeline.offload``): kind
            ``d2h`` (to the host, after an F) as a thin red bar under the rank's row, ``h2d``
            (back, before a B) as a thin teal bar over it.

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    stages: dict[int, set[int]] = {r: set() for r in range(num_ranks)}
    for rank, action, _, _ in timeline:
        stages[rank].add(action.stage)
    chunk = {(r, s): k for r, held in stages.items() for k, s in enumerate(sorted(held))}
    end = max([stop for *_, stop in timeline] + [stop for *_, stop in [*waits, *shards, *copies]], default=1.0)
    width = min(28.0, max(8.0, 0.3 * end / max(unit, 1e-9) + 2))
    fig, ax = plt.subplots(figsize=(width, 0.55 * num_ranks + 1.6))
    for rank, start, stop in waits:
        ax.broken_barh([(start, stop - start)], (rank - 0.15, 0.3), facecolors="0.75", linewidth=0)
    for rank, start, stop in shards:
        ax.broken_barh([(start, stop - start)], (rank - 0.15, 0.3), facecolors=_SHARD_COLOUR, linewidth=0)
    for rank, kind, start, stop in copies:  # under the row going out, over it coming back
        ax.broken_barh([(start, stop - start)], (rank + (0.4 if kind == "d2h" else -0.5), 0.1),
                       facecolors=_COPY_COLOURS[kind], linewidth=0)
    lanes = _pair_lanes(timeline)
    for index, (rank, action, start, stop) in enumerate(timeline):
        colour = chunk_colour(action.kind, chunk[rank, action.stage])
        lane = lanes.get(index)  # an overlapped pair's F on the upper half of the row, its B below
        low, height = (rank - 0.4, 0.8) if lane is None else (rank - 0.4 + 0.4 * lane, 0.4)
        ax.broken_barh([(start, stop - start)], (low, height), facecolors=colour,
                       edgecolors="black", linewidth=0.5)
        dark = sum(colour[:3]) < 1.5
        ax.text((start + stop) / 2, low + height / 2, str(action.microbatch), ha="center", va="center",
                fontsize=7, color="white" if dark else "black")
    ax.set_xlim(0, end)
    ax.set_ylim(num_ranks - 0.5, -0.5)
    ax.set_yticks(range(num_ranks), [f"rank {r}" for r in range(num_ranks)])
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    ax.set_axisbelow(True)
    chunks = max((len(held) for held in stages.values()), default=1)
    handles = _legend(timeline, chunks) + ([Patch(facecolor="0.75", label="comm (batched call)")] if waits else [])
    handles += [Patch(facecolor=_SHARD_COLOUR, label="unshard / reduce-scatter + reshard")] if shards else []
    if copies:
        handles += [Patch(facecolor=_COPY_COLOURS["d2h"], label="offload: activations to the host"),
                    Patch(facecolor=_COPY_COLOURS["h2d"], label="reload: back to the device")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize=7, frameon=False)
    fig.tight_layout()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _pair_lanes(timeline: Timeline) -> dict[int, int]:
    """Lanes of the actions that overlap another on their rank (an overlapped pair,
    ``pipeline.overlap_pairs``): {index in `timeline`: 0 for the earlier, 1 for the later}."""
    lanes: dict[int, int] = {}
    last: dict[int, tuple[int, float]] = {}  # rank -> (index, end) of its latest action
    for index in sorted(range(len(timeline)), key=lambda j: (timeline[j][0], timeline[j][2])):
        rank, _, start, stop = timeline[index]
        before = last.get(rank)
        if before is not None and start < before[1] - 1e-12:
            lanes.setdefault(before[0], 0)
            lanes[index] = 1
        if before is None or stop > before[1]:
            last[rank] = (index, stop)
    return lanes


def _legend(timeline: Timeline, chunks: int) -> list[Any]:
    from matplotlib.patches import Patch

    kinds = [kind for kind in "FBW" if any(action.kind == kind for _, action, _, _ in timeline)]
    handles = []
    for kind in kinds:
        for k in range(chunks):
            label = _NAMES[kind] + (f", chunk {k}" if chunks > 1 else "")
            handles.append(Patch(facecolor=chunk_colour(kind, k), edgecolor="black", label=label))
    return handles
