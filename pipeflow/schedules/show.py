"""Draw a schedule's simulated timeline: ``python -m pipeflow.schedules.show schedule=zbv ...``.

Arguments are Hydra-style ``key=value`` overrides (read with argparse, no Hydra needed; ``--help``
lists the keys)::

    python -m pipeflow.schedules.show schedule=zbv pipeline.num_stages=4 \\
        pipeline.num_microbatches=8 --out zbv.png
    python -m pipeflow.schedules.show schedule=interleaved_1f1b parallel.pp=4 \\
        schedule.stages_per_rank=2 costs.F=1 costs.B=2 costs.W=1
    python -m pipeflow.schedules.show schedule=custom schedule.path=my_schedule.txt
    python -m pipeflow.schedules.show schedule=zbv parallel.shard=full costs.shard=0.5
    python -m pipeflow.schedules.show schedule=gpipe parallel.pp=1 pipeline.offload=auto costs.copy=0.5
    python -m pipeflow.schedules.show --gallery docs/schedules   # every schedule, p=4, m=8

``pipeline.num_stages`` (or ``parallel.pp``) is the number of pipeline ranks p (default 4, m 8;
a custom file gives its own).  Costs are per
action; a B that also computes weight grads (no W scheduled) costs B + W.  ``parallel.shard=full``
lowers with the shard points and draws each stage's gather and reduction (``costs.shard`` each,
default 0).  ``pipeline.offload=auto|all`` plans the activation copies (each group's copy out
and back ``costs.copy``, default 0.25, on a copy engine beside compute) and draws them under
and over each rank's row.  The drawing itself is
``pipeflow.schedules.pictures``.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from pipeflow.errors import PipeflowError, ScheduleError
from pipeflow.schedules import GENERATORS, build_schedule, load_schedule, lower, simulate
from pipeflow.schedules.offload import HostLink, OffloadCosts, check_mode
from pipeflow.schedules.pictures import draw_timeline
from pipeflow.schedules.simulator import simulated_plan

_KEYS = {
    "schedule": "name",
    "schedule.name": "name",
    "schedule.path": "path",
    "pipeline.num_stages": "ranks",
    "parallel.pp": "ranks",
    "pipeline.num_microbatches": "microbatches",
    "schedule.stages_per_rank": "stages_per_rank",
    "schedule.placement": "placement",
    "pipeline.stages_per_rank": "stages_per_rank",  # the old names (docs/reference/renames.md)
    "pipeline.placement": "placement",
    "costs.F": "F",
    "costs.B": "B",
    "costs.W": "W",
    "parallel.shard": "shard",
    "costs.shard": "shard_cost",
    "pipeline.offload": "offload",
    "costs.copy": "copy_cost",
}


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes raise ScheduleError (exit status 2 through :func:`main`)."""

    def error(self, message: str) -> NoReturn:
        """Raise instead of printing and exiting, so callers see one kind of error."""
        raise ScheduleError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m pipeflow.schedules.show",
        description="Draw a schedule's simulated timeline (one row per rank, F / B / W boxes).",
        epilog="example: python -m pipeflow.schedules.show schedule=zbv pipeline.num_stages=4 "
               "pipeline.num_microbatches=8 --out zbv.png",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="Hydra-style settings; keys: " + ", ".join(sorted(_KEYS)))
    parser.add_argument("--out", help="the picture to write (default <schedule>.png; the suffix picks the format)")
    parser.add_argument("--gallery", metavar="DIR", help="draw every registered schedule into DIR instead")
    return parser


def parse_args(argv: Sequence[str]) -> dict[str, object]:
    """``key=value`` overrides and ``--out``/``--gallery`` into a dict of settings
    (``--help`` prints the usage and exits 0).

    Raises:
        ScheduleError: an unknown key or a value of the wrong type (the message lists the keys).
    """
    args = _parser().parse_intermixed_args(list(argv))
    settings: dict[str, object] = {}
    for arg in args.overrides:
        key = arg.split("=", 1)[0].lstrip("+")
        if "=" not in arg or key not in _KEYS:
            keys = ", ".join(sorted(_KEYS))
            raise ScheduleError(f"cannot read argument {arg!r}; valid keys: {keys}, --out, --gallery, --help")
        settings[_KEYS[key]] = _convert(key, arg.split("=", 1)[1])
    settings.update({name: getattr(args, name) for name in ("out", "gallery") if getattr(args, name) is not None})
    return settings


def _convert(key: str, value: str) -> object:
    target = _KEYS[key.lstrip("+")]
    try:
        if target in ("ranks", "microbatches", "stages_per_rank"):
            return int(value)
        if target in ("F", "B", "W", "shard_cost", "copy_cost"):
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
    shard = settings.get("shard", "none") == "full"
    cost = float(settings.get("shard_cost", 0.0))  # type: ignore[arg-type]
    offload = str(settings.get("offload", "none"))
    if offload != "none":  # each group's copy out (and back) takes costs.copy over a copy engine's link
        copy = float(settings.get("copy_cost", 0.25))  # type: ignore[arg-type]
        copies = OffloadCosts(lambda g: copy, HostLink(1.0, 1.0))
        plan = simulated_plan(schedule, check_mode(offload), copies, costs, shard=shard)
        result = simulate(schedule, lower(schedule, shard=shard, offload=plan), costs, shard_cost=cost, offload=copies)
    else:
        result = simulate(schedule, costs=costs, shard=shard, shard_cost=cost)
    p, S = schedule.num_ranks, schedule.num_stages
    layout = f"{S // p} stage{'s' if S > p else ''}/rank" if S % p == 0 else f"{S} stages"
    title = (
        f"{schedule.name}: p={p}, {layout}, m={schedule.num_microbatches}, "
        f"makespan {result.makespan:g}, bubble {result.bubble:.1%}"
    )
    out = Path(str(settings.get("out") or f"{name}.png"))
    shards = [(rank, start, end) for rank, _, start, end in result.shard_timeline]
    copied = [(rank, kind, start, end) for rank, events in enumerate(result.events)
              for kind, _, start, end in events if kind in ("d2h", "h2d")]
    if copied:
        title += f", offload={offload} ({sum(1 for c in copied if c[1] == 'd2h')} groups, copy {copy:g} each way)"
    return draw_timeline(result.timeline, p, title, out, shards=shards, copies=copied), result.bubble


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
