"""Draw a schedule's simulated timeline: ``python -m pipeflow.schedules.show schedule=zbv ...``.

Arguments are Hydra-style ``key=value`` overrides, read by hand so that this needs no Hydra::

    python -m pipeflow.schedules.show schedule=zbv pipeline.num_stages=4 \\
        pipeline.num_microbatches=8 --out zbv.png
    python -m pipeflow.schedules.show schedule=interleaved_1f1b parallel.pp=4 \\
        pipeline.stages_per_rank=2 costs.F=1 costs.B=2 costs.W=1
    python -m pipeflow.schedules.show schedule=custom schedule.path=my_schedule.txt
    python -m pipeflow.schedules.show --gallery docs/schedules   # every schedule, p=4, m=8

``pipeline.num_stages`` (or ``parallel.pp``) is the number of pipeline ranks p (default 4, m 8;
a custom file gives its own).  Costs are per
action; a B that also computes weight grads (no W scheduled) costs B + W.  The picture has one
row per rank, F / B / W boxes in their colours (later chunks of a rank in other shades), the
micro-batch in each box and idle time left white.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from pipeflow.errors import PipeflowError, ScheduleError  # noqa: E402
from pipeflow.schedules import GENERATORS, build_schedule, load_schedule, simulate  # noqa: E402
from pipeflow.schedules.ir import Action  # noqa: E402

Timeline = Sequence[tuple[int, Action, float, float]]  # (rank, action, start, end)
_CMAPS = {"F": "Blues", "B": "Oranges", "W": "Greens"}
_NAMES = {"F": "F forward", "B": "B backward", "W": "W weight grads"}
_KEYS = {
    "schedule": "name",
    "schedule.name": "name",
    "schedule.path": "path",
    "pipeline.num_stages": "ranks",
    "parallel.pp": "ranks",
    "pipeline.num_microbatches": "microbatches",
    "pipeline.stages_per_rank": "stages_per_rank",
    "pipeline.placement": "placement",
    "costs.F": "F",
    "costs.B": "B",
    "costs.W": "W",
}


def chunk_colour(kind: str, chunk: int) -> tuple[float, float, float, float]:
    """The fill of a `kind` box on a rank's `chunk`-th stage: darker for earlier chunks."""
    return plt.get_cmap(_CMAPS[kind])(max(0.2, 0.6 - 0.2 * chunk))


def draw_timeline(
    timeline: Timeline,
    num_ranks: int,
    title: str,
    out_path: str | Path,
    waits: Sequence[tuple[int, float, float]] = (),
    xlabel: str = "time",
    unit: float = 1.0,
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

    Returns:
        The path written.
    """
    stages: dict[int, set[int]] = {r: set() for r in range(num_ranks)}
    for rank, action, _, _ in timeline:
        stages[rank].add(action.stage)
    chunk = {(r, s): k for r, held in stages.items() for k, s in enumerate(sorted(held))}
    end = max([stop for *_, stop in timeline] + [stop for *_, stop in waits], default=1.0)
    width = min(28.0, max(8.0, 0.3 * end / max(unit, 1e-9) + 2))
    fig, ax = plt.subplots(figsize=(width, 0.55 * num_ranks + 1.6))
    for rank, start, stop in waits:
        ax.broken_barh([(start, stop - start)], (rank - 0.15, 0.3), facecolors="0.75", linewidth=0)
    for rank, action, start, stop in timeline:
        colour = chunk_colour(action.kind, chunk[rank, action.stage])
        ax.broken_barh([(start, stop - start)], (rank - 0.4, 0.8), facecolors=colour,
                       edgecolors="black", linewidth=0.5)
        dark = sum(colour[:3]) < 1.5
        ax.text((start + stop) / 2, rank, str(action.microbatch), ha="center", va="center",
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
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize=7, frameon=False)
    fig.tight_layout()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _legend(timeline: Timeline, chunks: int) -> list[Patch]:
    kinds = [kind for kind in "FBW" if any(action.kind == kind for _, action, _, _ in timeline)]
    handles = []
    for kind in kinds:
        for k in range(chunks):
            label = _NAMES[kind] + (f", chunk {k}" if chunks > 1 else "")
            handles.append(Patch(facecolor=chunk_colour(kind, k), edgecolor="black", label=label))
    return handles


def parse_args(argv: Sequence[str]) -> dict[str, object]:
    """``key=value`` overrides and ``--out``/``--gallery`` into a dict of settings.

    Raises:
        ScheduleError: an unknown key or a value of the wrong type (the message lists the keys).
    """
    settings: dict[str, object] = {}
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("--out", "--gallery"):
            if not args:
                raise ScheduleError(f"{arg} needs a path")
            settings[arg[2:]] = args.pop(0)
        elif arg.startswith(("--out=", "--gallery=")):
            key, value = arg[2:].split("=", 1)
            settings[key] = value
        elif "=" in arg and arg.split("=", 1)[0].lstrip("+") in _KEYS:
            key, value = arg.split("=", 1)
            settings[_KEYS[key.lstrip("+")]] = _convert(key, value)
        else:
            keys = ", ".join(sorted(_KEYS))
            raise ScheduleError(f"cannot read argument {arg!r}; valid keys: {keys}, --out, --gallery")
    return settings


def _convert(key: str, value: str) -> object:
    target = _KEYS[key.lstrip("+")]
    try:
        if target in ("ranks", "microbatches", "stages_per_rank"):
            return int(value)
        if target in ("F", "B", "W"):
            return float(value)
    except ValueError:
        raise ScheduleError(f"{key}={value!r}: expected a number") from None
    return value


def show(settings: dict[str, object]) -> tuple[Path, float]:
    """Build, simulate and draw the schedule the settings describe; returns (path, bubble)."""
    name = str(settings.get("name", "1f1b"))
    if name == "custom" and "path" in settings and not {"ranks", "microbatches"} & set(settings):
        schedule = load_schedule(str(settings["path"]))  # sizes from the file
    else:
        schedule = build_schedule(
            name,
            int(settings.get("ranks", 4)),  # type: ignore[arg-type]
            int(settings.get("microbatches", 8)),  # type: ignore[arg-type]
            settings.get("stages_per_rank"),  # type: ignore[arg-type]
            settings.get("placement"),  # type: ignore[arg-type]
            settings.get("path"),  # type: ignore[arg-type]
        )
    costs = {kind: float(settings[kind]) for kind in "FBW" if kind in settings}  # type: ignore[arg-type]
    result = simulate(schedule, costs=costs)
    p, S = schedule.num_ranks, schedule.num_stages
    layout = f"{S // p} stage{'s' if S > p else ''}/rank" if S % p == 0 else f"{S} stages"
    title = (
        f"{schedule.name}: p={p}, {layout}, m={schedule.num_microbatches}, "
        f"makespan {result.makespan:g}, bubble {result.bubble:.1%}"
    )
    out = Path(str(settings.get("out") or f"{name}.png"))
    return draw_timeline(result.timeline, p, title, out), result.bubble


def gallery(out_dir: str | Path, num_ranks: int = 4, num_microbatches: int = 8) -> list[Path]:
    """One picture per registered schedule, ``<out_dir>/<name>.png``."""
    return [
        show({"name": name, "ranks": num_ranks, "microbatches": num_microbatches,
              "out": Path(out_dir) / f"{name}.png"})[0]
        for name in GENERATORS
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    try:
        settings = parse_args(sys.argv[1:] if argv is None else argv)
        if "gallery" in settings:
            ranks, micro = settings.get("ranks", 4), settings.get("microbatches", 8)
            for path in gallery(str(settings["gallery"]), int(ranks), int(micro)):  # type: ignore[arg-type]
                print(f"wrote {path}")
            return 0
        path, bubble = show(settings)
    except PipeflowError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path} (bubble {bubble:.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
