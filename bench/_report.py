"""What the step benchmarks share in their reports: the JSON file and the load line."""

from __future__ import annotations

import json
import os


def write_json(path: str | None, data: dict) -> None:
    """Writes ``data`` to ``path`` as indented JSON (nothing when ``path`` is None)."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)


def load_average() -> str:
    """The one-minute load average, for the report (other work shares the CPU)."""
    return f"load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
