"""Incremental durable checkpoints of the embedding tables (Check-N-Run, NSDI'22).

A recommendation model's checkpoint is mostly its embedding tables, and an interval touches
a fraction of their rows. The fused sparse optimizer (exact Adagrad) changes a row and its
state only when a batch looks it up, so the rows a commit must write are the ids the
batches' KeyedJaggedTensors carried since the previous commit:

* ``TouchedRows`` marks them, one bitmap per table, on the training step (one index write
  per feature). Marking more rows than changed is harmless: a delta only grows.
* ``Incremental.plan`` decides at each durable save whether it is a full snapshot or a
  delta, and for a delta takes, from every table leaf of the state (the tables' sharded
  weights and their optimizer state rows), this rank's touched local rows. The dense rest
  of the state is written by DCP as usual; the rows go to ``rows.rank<r>.pt``.

Every rank sees only its own batch while a table-wise sharded table is updated by every
rank's ids, so the bitmaps are OR-ed over the ranks (one all-reduce of a byte per row) at
each save, together with whether the previous save committed on every rank. A delta needs
its previous link: after a failed save, a restore, or for the anchor, the commit is full.
Restore composes the chain (compose.py); the chain's bookkeeping is infra/checkpoint_chain.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from infra.checkpoint_manifest import CommitKind
from infra.settings import IncrementalConfig

ROWS_KEY = "leaves"  # rows file: {ROWS_KEY: {leaf path: {shard key: {"ids", "rows"}}}}


def rows_file(rank: int) -> str:
    """This rank's touched rows in a delta checkpoint's folder."""
    return f"rows.rank{rank:03d}.pt"


def embedding_tables(model: nn.Module) -> dict[str, tuple[str, int]]:
    """feature name -> (table name, rows), for every embedding collection of the model,
    sharded or not (TorchRec's collections keep their table configs; the sharded ones
    privately)."""
    features: dict[str, tuple[str, int]] = {}
    for module in model.modules():
        configs = None
        for name in ("embedding_bag_configs", "embedding_configs"):
            public = getattr(module, name, None)
            private = getattr(module, f"_{name}", None)
            if callable(public):
                configs = public()
            elif isinstance(private, list):
                configs = private
        for table in configs or ():
            for feature in table.feature_names:
                features[feature] = (table.name, table.num_embeddings)
    return features


class TouchedRows:
    """One bitmap per table of the rows looked up since ``take`` (on the ids' device)."""

    def __init__(self, features: Mapping[str, tuple[str, int]]) -> None:
        self.features = dict(features)
        self.rows = {table: rows for table, rows in self.features.values()}
        self.bitmaps: dict[str, torch.Tensor] = {}

    def track(self, kjts: Iterable[Any]) -> None:
        """Mark the ids of each KeyedJaggedTensor's features that name a table."""
        for kjt in kjts:
            values = kjt.values()
            for key, ids in zip(kjt.keys(), values.split(kjt.length_per_key()), strict=True):
                table = self.features.get(key)
                if table is None or ids.numel() == 0:
                    continue
                bitmap = self.bitmaps.get(table[0])
                if bitmap is None:
                    bitmap = torch.zeros(table[1], dtype=torch.bool, device=ids.device)
                    self.bitmaps[table[0]] = bitmap
                bitmap[ids] = True

    def take(self) -> dict[str, torch.Tensor]:
        """Every table's bitmap (on CPU, zeros for tables not looked up), and start anew."""
        taken = {
            table: self.bitmaps[table].cpu()
            if table in self.bitmaps
            else torch.zeros(rows, dtype=torch.bool)
            for table, rows in sorted(self.rows.items())
        }
        self.bitmaps = {}
        return taken


@dataclass(frozen=True)
class Link:
    """What one durable commit is in its chain (the manifest records it)."""

    kind: CommitKind
    base_step: int
    previous_step: int | None = None
    reason: str = ""  # why full: "first", "full_every", "share", "anchor", "previous_failed"


@dataclass
class Plan:
    """One save: the state DCP writes, and for a delta the rows file's payload."""

    link: Link
    dense: dict[str, Any]
    rows: dict[str, Any] | None = None


def table_of(path: str, tables: Mapping[str, int], leaf: Any) -> str | None:
    """The table a sharded state leaf holds rows of (its weight or its optimizer state):
    a ShardedTensor whose path names the table and whose first dimension is its rows."""
    if not isinstance(leaf, ShardedTensor):
        return None
    for part in path.split("."):
        rows = tables.get(part)
        if rows is not None and leaf.metadata().size[0] == rows:
            return part
    return None


def leaves(tree: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from leaves(value, path + ".")
        else:
            yield path, value


def without(tree: Mapping[str, Any], paths: set[str], prefix: str = "") -> dict[str, Any]:
    """The nested state without the leaves at ``paths`` (the tables, for DCP's part)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out[key] = without(value, paths, path + ".")
        elif path not in paths:
            out[key] = value
    return out


def leaf_at(tree: Mapping[str, Any], path: str) -> Any:
    """The leaf at a dotted ``path``: keys may hold dots, so match them greedily."""
    node: Any = tree
    rest = path
    while rest:
        key = next(
            (
                k
                for k in sorted(node, key=len, reverse=True)
                if rest == k or rest.startswith(k + ".")
            ),
            None,
        )
        if key is None:
            raise KeyError(path)
        node, rest = node[key], rest[len(key) + 1 :]
    return node


def shard_key(shard: Any) -> str:
    return ",".join(str(o) for o in shard.metadata.shard_offsets)


def gather_rows(state: Mapping[str, Any], touched: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Every table leaf's touched local rows, copied: {path: {shard key: {ids, rows}}}."""
    out: dict[str, Any] = {}
    for path, leaf in leaves(state):
        table = table_of(path, {t: b.numel() for t, b in touched.items()}, leaf)
        if table is None:
            continue
        shards = {}
        for shard in leaf.local_shards():
            first = shard.metadata.shard_offsets[0]
            size = shard.metadata.shard_sizes[0]
            ids = touched[table][first : first + size].nonzero().flatten()
            rows = shard.tensor.index_select(0, ids.to(shard.tensor.device)).cpu()
            shards[shard_key(shard)] = {"ids": ids, "rows": rows}
        out[path] = shards
    return out


def apply_rows(state: Mapping[str, Any], payload: Mapping[str, Any]) -> None:
    """Write a delta's rows into the state's table leaves, in place: a ShardedTensor's
    local shards, or (one process reading every rank's rows: publishing) a plain tensor at
    each shard's offsets. Leaves the state does not hold are passed over: the optimizer's
    when only the model is loaded, and, as every rank reads every rank's rows, another
    rank's optimizer state (the fused optimizer keeps only its own tables')."""
    for path, shards in payload[ROWS_KEY].items():
        try:
            leaf = leaf_at(state, path)
        except KeyError:  # another rank's optimizer state, or a part not loaded
            continue
        for key, part in shards.items():
            first, col = (int(o) for o in key.split(",")[:2])
            global_ids = part["ids"] + first
            if not isinstance(leaf, ShardedTensor):
                rows = part["rows"].to(leaf.device)
                block = leaf[:, col : col + rows.shape[1]]
                block.index_copy_(0, global_ids.to(leaf.device), rows)
                continue
            # Written by any rank at any world size: each local shard takes the rows it holds.
            for shard in leaf.local_shards():
                start, start_col = shard.metadata.shard_offsets[:2]
                if start_col != col:
                    continue
                held = (global_ids >= start) & (global_ids < start + shard.metadata.shard_sizes[0])
                if held.any():
                    target = shard.tensor
                    ids = (global_ids[held] - start).to(target.device)
                    rows = part["rows"][held].to(target.device)
                    target.index_copy_(0, ids, rows)


class Incremental:
    """One per rank: the rows touched since the last durable save and the chain so far."""

    def __init__(
        self,
        config: IncrementalConfig,
        features: Mapping[str, tuple[str, int]],
        world_size: int,
        process_group: dist.ProcessGroup | None,
    ) -> None:
        self.config, self.world_size, self.pg = config, world_size, process_group
        self.touched = TouchedRows(features)
        self.previous: Link | None = None  # the last save's link (None: next one is full)
        self.previous_step = 0
        self.deltas_since_full = 0

    def track(self, *kjts: Any) -> None:
        self.touched.track(kjts)

    def reset(self) -> None:
        """The state was restored: what was touched is unknown, the next commit is full."""
        self.touched.take()
        self.previous = None

    def _agree(self, touched: dict[str, torch.Tensor], ok: bool) -> tuple[dict, bool]:
        """OR the bitmaps over the ranks, and AND whether each rank's previous save stored
        its part (one all-reduce)."""
        if self.world_size == 1 or self.pg is None:
            return touched, ok
        flat = torch.cat(
            [b.to(torch.uint8) for b in touched.values()]
            + [torch.tensor([0 if ok else 1], dtype=torch.uint8)]
        )
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.pg)
        out, at = {}, 0
        for table, bitmap in touched.items():
            out[table] = flat[at : at + bitmap.numel()].bool()
            at += bitmap.numel()
        return out, not bool(flat[-1])

    def plan(self, step: int, state: dict[str, Any], previous_ok: bool, anchor: bool) -> Plan:
        """Full or delta for the save at ``step`` (collective on the checkpoint group)."""
        touched, previous_ok = self._agree(self.touched.take(), previous_ok)
        reason = ""
        if anchor:
            reason = "anchor"
        elif self.previous is None:
            reason = "first"
        elif not previous_ok:
            reason = "previous_failed"
        elif self.deltas_since_full + 1 >= self.config.full_every:
            reason = "full_every"
        elif any(
            b.numel() and b.sum().item() > self.config.max_delta_share * b.numel()
            for b in touched.values()
        ):
            reason = "share"
        if reason or self.previous is None:
            link = Link(CommitKind.FULL, step, reason=reason)
            self.deltas_since_full = 0
            plan = Plan(link, state)
        else:
            link = Link(CommitKind.DELTA, self.previous.base_step, self.previous_step)
            self.deltas_since_full += 1
            rows = gather_rows(state, touched)
            plan = Plan(link, without(state, set(rows)), {ROWS_KEY: rows})
        self.previous, self.previous_step = link, step
        return plan
