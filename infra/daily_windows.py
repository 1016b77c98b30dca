"""Daily data windows: the layout the ``retrain`` flow reads and ``ett generate --daily``
writes, in one place.

    <root>/dt=2026-11-29/...   one folder per day
    <root>/dt=2026-11-29/_meta.json or _SUCCESS   written last: the window is complete
"""

from __future__ import annotations

import re
from datetime import date

DEFAULT_ROOT = "file://./runs/data/daily"  # the retrain deployment's data_root
PARTITION = re.compile(r"dt=(\d{4}-\d{2}-\d{2})")
COMPLETE_MARKERS = ("_meta.json", "_SUCCESS")


def partition_name(day: date) -> str:
    return f"dt={day.isoformat()}"
