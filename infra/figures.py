"""Pictures for people: matplotlib without a display, and PNGs written whole.

One place, so the ETT, fleet and simulate reports make and save their plots the same way.
matplotlib is imported on first use only: the calculators and the CLI's help never load it.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend (flows, workers and tests have no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, path: str | Path, dpi: int = 110) -> Path:
    """Lay ``fig`` out, write it to ``path`` (its folder made if needed) and close it."""
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    pyplot().close(fig)
    return out
