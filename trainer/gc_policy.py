"""When Python's cyclic garbage collector runs in a launcher and its ranks.

A full collection walks every object the process holds. Once torch, TorchRec and Inductor
are imported that is half a million objects or more, so each full collection is a pause of
a few tenths of a second, and the collector starts them on its own while the imports
allocate: on the path of Time to Start, and later in the middle of a training step.

- **While starting** (imports, init) the collector is off. Starting makes almost no cyclic
  garbage; what it makes lives as long as the process.
- **Once started** everything alive is frozen (``gc.freeze``): moved out of the collector's
  generations, so no later collection walks it again, and a forked rank's pages stay
  shared with its launcher. Then the collector is on again, and its collections walk only
  what was made since.

The cost: cyclic garbage made while starting is not freed until the process exits
(``gc.freeze`` freezes it too). At exit the frozen objects are thawed, so the interpreter's
last collection frees them as it would have (extension modules that count their objects,
as Triton's do, otherwise report them as leaked).
"""

from __future__ import annotations

import atexit
import gc
import logging

log = logging.getLogger(__name__)


def pause() -> None:
    """Turn the collector off while the process starts."""
    gc.disable()


_thaw_registered = False  # a forked rank inherits it with its parent's atexit handlers


def settle() -> None:
    """The process has started: freeze what it holds, and collect again from here on.
    (Not ``gc.get_freeze_count()``: it walks every frozen object, some 50 ms.)"""
    global _thaw_registered
    if not _thaw_registered:
        atexit.register(gc.unfreeze)
        _thaw_registered = True
    gc.freeze()
    gc.enable()
    log.info("started: what this process holds is frozen, garbage collection is on")
