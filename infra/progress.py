"""Progress bars for long commands (tqdm), shown only to a person at a terminal.

Off when stderr is not a TTY (pipes, CI logs, a Prefect worker): there a bar would only
add carriage-return noise to the log. While a bar is shown, log lines of the given loggers
are written above it instead of through it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Sequence

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm


def shown() -> bool:
    return sys.stderr.isatty()


@contextlib.contextmanager
def counter(total: int, desc: str, unit: str, loggers: Sequence[str] = ()) -> Iterator[tqdm]:
    """A bar over ``total`` units; call ``.update()`` after each one."""
    with _above_logs(loggers), tqdm(total=total, desc=desc, unit=unit, disable=not shown()) as bar:
        yield bar


@contextlib.contextmanager
def stages(
    names: Sequence[str], desc: str, loggers: Sequence[str] = ()
) -> Iterator[Callable[[str], None]]:
    """A bar over named stages; yields ``enter(name)``, to call as each stage begins."""
    with counter(len(names), desc, "stage", loggers) as bar:
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
def _above_logs(names: Sequence[str]) -> Iterator[None]:
    if not shown():
        yield
        return
    loggers = [logging.getLogger(n) for n in names] or [logging.getLogger()]
    with logging_redirect_tqdm(loggers=loggers):
        yield
