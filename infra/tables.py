"""Tables for people: rich in a terminal, plain aligned text when piped or logged, markdown
for Prefect artifacts. One place, so every report (ETT, fleet, stack) looks the same.

A report is a list of sections, each ``(title, header, rows)`` with rows of strings.
"""

from __future__ import annotations

import io
import sys
from typing import IO

from rich import box
from rich.console import Console
from rich.table import Table

Section = tuple[str, list[str], list[list[str]]]
PLAIN_WIDTH = 10_000  # piped output is never wrapped: one row, one line
_LITERAL = {"markup": False, "emoji": False, "highlight": False}  # cells are data, not markup


def _table(header: list[str], rows: list[list[str]], title: str | None, fancy: bool) -> Table:
    table = Table(
        *header,
        title=title,
        title_justify="left",
        box=box.ROUNDED if fancy else None,
        header_style="bold" if fancy else "",
        pad_edge=fancy,
        show_edge=fancy,
    )
    for row in rows:
        table.add_row(*row)
    return table


def _render(sections: list[Section], console: Console, fancy: bool) -> None:
    for title, header, rows in sections:
        if not fancy:
            console.print(f"== {title} ==")
        if not rows:
            console.print(f"{title}: (none)" if fancy else "(none)")
        else:
            console.print(_table(header, rows, title if fancy else None, fancy))
        console.print()


def to_text(sections: list[Section]) -> str:
    """Plain aligned columns: for pipes, log files and Prefect logs."""
    out = io.StringIO()
    console = Console(file=out, width=PLAIN_WIDTH, color_system=None, **_LITERAL)
    _render(sections, console, fancy=False)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()).strip() + "\n"


def is_terminal(stream: IO[str]) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


def show(sections: list[Section], stream: IO[str] | None = None) -> None:
    """Print ``sections``: rich tables in a terminal, :func:`to_text` anywhere else."""
    stream = stream or sys.stdout
    if is_terminal(stream):
        _render(sections, Console(file=stream, **_LITERAL), fancy=True)
    else:
        stream.write(to_text(sections))
        stream.flush()


def to_markdown(sections: list[Section]) -> str:
    """One markdown table per section (``|`` in cells escaped), for Prefect artifacts."""
    out: list[str] = []
    for title, header, rows in sections:
        out += ["", f"## {title}", ""]
        if not rows:
            out.append("_none_")
            continue
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "|".join("---" for _ in header) + "|")
        out += ["| " + " | ".join(x.replace("|", "\\|") for x in row) + " |" for row in rows]
    return "\n".join(out) + "\n"
