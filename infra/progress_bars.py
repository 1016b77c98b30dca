"""Progress bars for long commands (tqdm), shown only to a person at a terminal.

Off when stderr is not a TTY (pipes, CI logs, a Prefect worker): there a bar would only
add carriage-return noise to the log. While a bar is shown, the root logger's lines (every
logger propagates there) are written above it instead of through it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Sequence

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from infra.library_logs import quiet_library_dumps


def shown() -> bool:
    return sys.stderr.isatty()


@contextlib.contextmanager
def counter(total: int, desc: str, unit: str) -> Iterator[tqdm]:
    """A bar over ``total`` units; call ``.update()`` after each one."""
    with _above_logs(), tqdm(total=total, desc=desc, unit=unit, disable=not shown()) as bar:
        yield bar


@contextlib.contextmanager
def stages(names: Sequence[str], desc: str) -> Iterator[Callable[[str], None]]:
    """A bar over named stages; yields ``enter(name)``, to call as each stage begins."""
    with counter(len(names), desc, "stage") as bar:
        begun = 0

        def enter(name: str) -> None:
            nonlocal begun
            if begun:
                bar.update(1)
            begun += 1
            bar.set_postfix_str(name)

        yield enter
        bar.update(len(names) - bar.n)


@contextlib.contextmanager
def _above_logs() -> Iterator[None]:
    if not shown():
        yield
        return
    with logging_redirect_tqdm(loggers=[logging.getLogger()]):
        quiet_library_dumps()  # the stand-in handler needs the filter too
        yield
