"""Appending a benchmark's table to benchmarks/RESULTS.md with how, where and when it was made."""
from __future__ import annotations

import datetime
import os
import platform

import torch


def append_result(path: str, title: str, command: str, text: str, backend: str = "gloo", device_name: str = "") -> None:
    """Append `text` under a heading `title (date UTC)` and a line with the command and machine."""
    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores" + (f", {device_name}" if device_name else "")
    header = (
        f"\n### {title} ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)\n\n"
        f"`{command}` on {machine}, torch {torch.__version__}, {backend}, "
        f"load average {os.getloadavg()[0]:.1f} at the end\n\n"
    )
    with open(path, "a") as f:
        f.write(header + text + "\n")
