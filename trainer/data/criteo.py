"""Reader for the Criteo click-log TSV layout, producing the synthetic data's columns.

Each line: label, 13 integer features, 26 categorical features (32-bit hex), tab-separated;
an empty field is missing (0 for integers, id 0 for categoricals). Output columns:
``dense`` = log1p(max(x, 0)), ``cat`` = int(hex, 16) % (vocab_f - 1) + 1 (id 0 is reserved
for "missing"), ``item`` = 0 and an empty ``history``. Malformed lines (wrong column count,
unparsable integer, non-hex categorical, label not 0/1) are counted, logged with
file:line, and skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from infra import storage
from infra.settings import DataConfig

log = logging.getLogger(__name__)

NUM_DENSE = 13
NUM_CAT = 26
NUM_COLUMNS = 1 + NUM_DENSE + NUM_CAT
_LOGGED_BAD_LINES = 10  # per reader; later bad lines are only counted
CHUNK_LINES = 65_536  # lines parsed at once by ``read``: bounds memory for big files


def check_config(data: DataConfig) -> None:
    """Raise ValueError unless ``data`` describes the Criteo schema."""
    if len(data.cat_vocab_sizes) != NUM_CAT:
        raise ValueError(
            f"data.format='criteo' needs data.cat_vocab_sizes with {NUM_CAT} entries (one per "
            f"Criteo categorical feature), got {len(data.cat_vocab_sizes)}"
        )
    if data.num_dense != NUM_DENSE:
        raise ValueError(
            f"data.format='criteo' needs data.num_dense={NUM_DENSE}, got {data.num_dense}"
        )


@dataclass
class ParsedLines:
    """Columns of the good lines; ``index`` says which input line each row came from."""

    label: np.ndarray  # float32 [n]
    dense: np.ndarray  # float32 [n, 13]
    cat: np.ndarray  # int64 [n, 26]
    index: np.ndarray  # int64 [n], position in the input sequence
    bad: int


class LineParser:
    """Parses Criteo lines; counts bad ones and logs the first few with file:line."""

    def __init__(self, data: DataConfig) -> None:
        check_config(data)
        self.buckets = [v - 1 for v in data.cat_vocab_sizes]
        self.bad = 0

    def _parse(self, line: str) -> tuple[float, list[int], list[int]] | str:
        fields = line.rstrip("\r\n").split("\t")
        if len(fields) != NUM_COLUMNS:
            return f"{len(fields)} columns, expected {NUM_COLUMNS}"
        if fields[0] not in ("0", "1"):
            return f"label {fields[0]!r} is not 0 or 1"
        try:
            ints = [int(x) if x else 0 for x in fields[1 : 1 + NUM_DENSE]]
        except ValueError:
            return "unparsable integer feature"
        try:
            cats = [
                int(x, 16) % b + 1 if x else 0
                for x, b in zip(fields[1 + NUM_DENSE :], self.buckets, strict=True)
            ]
        except ValueError:
            return "non-hex categorical feature"
        return float(fields[0]), ints, cats

    def parse(self, lines: Sequence[str], line_numbers: Sequence[int], source: str) -> ParsedLines:
        """Parse ``lines``; ``line_numbers`` (1-based, for messages) name where each came from."""
        labels: list[float] = []
        ints: list[list[int]] = []
        cats: list[list[int]] = []
        index: list[int] = []
        bad = 0
        for i, line in enumerate(lines):
            parsed = self._parse(line)
            if isinstance(parsed, str):
                bad += 1
                self.bad += 1
                if self.bad <= _LOGGED_BAD_LINES:
                    log.warning("criteo: skipping %s:%d: %s", source, line_numbers[i], parsed)
                    if self.bad == _LOGGED_BAD_LINES:
                        log.warning("criteo: further bad lines are counted, not logged")
                continue
            labels.append(parsed[0])
            ints.append(parsed[1])
            cats.append(parsed[2])
            index.append(i)
        n = len(labels)
        dense = np.asarray(ints, dtype=np.float64).reshape(n, NUM_DENSE)
        return ParsedLines(
            label=np.asarray(labels, dtype=np.float32),
            dense=np.log1p(np.maximum(dense, 0)).astype(np.float32),
            cat=np.asarray(cats, dtype=np.int64).reshape(n, NUM_CAT),
            index=np.asarray(index, dtype=np.int64),
            bad=bad,
        )


def iter_line_chunks(url: str, chunk_lines: int, skip_lines: int = 0) -> Iterator[list[str]]:
    """Lines of a text file in lists of ``chunk_lines`` (the last may be shorter), streamed;
    the first ``skip_lines`` lines are read past without being returned."""
    chunk: list[str] = []
    with storage.open_file(url, "rb") as fh:
        for i, raw in enumerate(fh):
            if i < skip_lines:
                continue
            chunk.append(raw.decode("utf-8", errors="replace"))
            if len(chunk) == chunk_lines:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def read(url: str, data: DataConfig, chunk_lines: int = CHUNK_LINES) -> Iterator[ParsedLines]:
    """Parse a whole Criteo TSV file in order, chunk by chunk (``index`` is the 0-based line)."""
    parser = LineParser(data)
    start = 0
    for lines in iter_line_chunks(url, chunk_lines):
        numbers = range(start + 1, start + len(lines) + 1)
        parsed = parser.parse(lines, numbers, url)
        parsed.index += start
        start += len(lines)
        yield parsed
