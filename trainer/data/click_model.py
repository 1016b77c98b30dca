"""The planted click model of the synthetic data: drawn from the seed, used to sample rows.

    logit = bias + dense.w + 0.5 * dense0 * dense1 + sum_f b_f[cat_f] + b_item[item]
            + alpha * <sum_h w_h L[h] / sum_h w_h, L[item]> / sqrt(latent_dim)

Items belong to topics (their latent vectors cluster). A user's interest drifts: the most
recent items of a history come mostly from the user's current topic, older ones mostly from
a previous topic, and the candidate item comes from the current topic 40% of the time. The
history/item term weighs each history item h by its recency, w_h = 2^(-age_h / 2) (age 0 =
the most recent item), as clicks follow recent interest in real logs. So order carries
signal: a mean-pooled history tower learns part of it, a sequence tower with positions can
learn all of it. Ids are Zipf-distributed (frequent ids dominate). The sum runs over the last
``data.max_history_len`` items, exactly what the loader keeps, so the Bayes AUC that
trainer/data/synthetic.py computes from the true logits is a true ceiling for a model fed by
the loader. None of it is ever written out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from infra.settings import DataConfig

# Calibration of the planted model: with the defaults the Bayes AUC is ~0.81 (~0.70 with the
# history/item term dropped) and ~30% of the rows are clicks.
_BIAS = -1.8
_DENSE_STD = 0.4  # std of dense.w
_NONLINEAR = 0.5  # weight of dense0 * dense1
_CAT_STD = 0.22  # std of each categorical feature's per-id effect
_ITEM_STD = 0.3
_ALPHA = 1.0  # weight of the history/item interaction
_TOPICS = 8
_TOPIC_SHARE = 0.9  # share of a latent vector's variance that comes from its topic
_P_CANDIDATE_IN_TOPIC = 0.4
# Interest drift: a history item of age < _RECENT_ITEMS comes from the current topic with
# probability 0.8 (else the previous topic 0.1); older ones 0.1 (previous topic 0.8). The
# remaining 10% are random items. With these the recency weighting is worth ~0.024 AUC:
# the meta's auc_uniform_history_mean (0.789 with the defaults) against bayes_auc (0.813).
_RECENT_ITEMS = 8
_P_CURRENT_RECENT, _P_CURRENT_OLD, _P_FROM_TOPICS = 0.8, 0.1, 0.9
_RECENCY_HALF_LIFE = 2.0  # items: the weight of a history item in the history/item term


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _zipf_cdf(n: int, a: float) -> np.ndarray:
    weights = np.arange(1, n + 1, dtype=np.float64) ** -a
    cdf = np.cumsum(weights)
    return cdf / cdf[-1]


def _zipf(rng: np.random.Generator, cdf: np.ndarray, size: int | tuple[int, ...]) -> np.ndarray:
    """Popularity ranks in [0, len(cdf)) from a Zipf law truncated to the vocabulary."""
    ranks = np.searchsorted(cdf, rng.random(size), side="right")
    return np.minimum(ranks, cdf.size - 1)


@dataclass
class Planted:
    """The ground truth: drawn from the seed, used to sample rows, never written out."""

    w: np.ndarray  # [num_dense]
    cat_bias: list[np.ndarray]  # per feature, [vocab_f]
    cat_perm: list[np.ndarray]  # popularity rank -> id, per feature
    cat_cdf: list[np.ndarray]
    item_bias: np.ndarray  # [item_vocab]
    latent: np.ndarray  # [item_vocab, latent_dim] float32
    item_perm: np.ndarray  # popularity rank -> item id; item perm[r] is in topic r % topics
    item_cdf: np.ndarray
    topic_cdf: np.ndarray  # within-topic popularity
    topics: int


def plant(data: DataConfig) -> Planted:
    gen = data.generator
    rng = np.random.default_rng([gen.seed & 0xFFFF_FFFF_FFFF_FFFF, 0, 0])
    num_items, dim = data.item_vocab_size, gen.latent_dim
    topics = max(1, min(_TOPICS, num_items // 2))
    item_perm = rng.permutation(num_items)
    topic_of_item = np.empty(num_items, dtype=np.int64)
    topic_of_item[item_perm] = np.arange(num_items) % topics
    centers = rng.standard_normal((topics, dim))
    latent = math.sqrt(_TOPIC_SHARE) * centers[topic_of_item] + math.sqrt(
        1 - _TOPIC_SHARE
    ) * rng.standard_normal((num_items, dim))
    return Planted(
        w=rng.standard_normal(data.num_dense) * _DENSE_STD / math.sqrt(data.num_dense),
        cat_bias=[rng.standard_normal(v) * _CAT_STD for v in data.cat_vocab_sizes],
        cat_perm=[rng.permutation(v) for v in data.cat_vocab_sizes],
        cat_cdf=[_zipf_cdf(v, gen.zipf_a) for v in data.cat_vocab_sizes],
        item_bias=rng.standard_normal(num_items) * _ITEM_STD,
        latent=latent.astype(np.float32),
        item_perm=item_perm,
        item_cdf=_zipf_cdf(num_items, gen.zipf_a),
        topic_cdf=_zipf_cdf(num_items // topics, gen.zipf_a),
        topics=topics,
    )


def sample(
    planted: Planted, data: DataConfig, rng: np.random.Generator, n: int
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """n rows: (columns, true logit, the history/item term of the logit, and that term with
    the recency weights replaced by a plain mean: what mean pooling can express)."""
    gen = data.generator
    topics = planted.topics

    dense = rng.standard_normal((n, data.num_dense)).astype(np.float32)
    cat = np.stack(
        [
            perm[_zipf(rng, cdf, n)]
            for perm, cdf in zip(planted.cat_perm, planted.cat_cdf, strict=True)
        ],
        axis=1,
    ).astype(np.int64)

    # History lengths: geometric on {0, 1, ...} with the configured mean (skewed, some empty).
    lengths = rng.geometric(1.0 / (gen.mean_history_len + 1.0), n) - 1
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    main_topic = rng.integers(0, topics, n)  # the current interest
    second_topic = rng.integers(0, topics, n)  # the previous one
    row_of = np.repeat(np.arange(n), lengths)
    age = lengths[row_of] - 1 - (np.arange(total) - offsets[row_of])  # 0 = most recent
    u = rng.random(total)
    history = np.empty(total, dtype=np.int64)
    local = u < _P_FROM_TOPICS  # from the user's topics, else anywhere
    rows = row_of[local]
    p_current = np.where(age[local] < _RECENT_ITEMS, _P_CURRENT_RECENT, _P_CURRENT_OLD)
    topic = np.where(u[local] < p_current, main_topic[rows], second_topic[rows])
    history[local] = planted.item_perm[_zipf(rng, planted.topic_cdf, rows.size) * topics + topic]
    history[~local] = planted.item_perm[_zipf(rng, planted.item_cdf, total - rows.size)]

    item = np.empty(n, dtype=np.int64)
    in_topic = rng.random(n) < _P_CANDIDATE_IN_TOPIC
    k = int(in_topic.sum())
    item[in_topic] = planted.item_perm[
        _zipf(rng, planted.topic_cdf, k) * topics + main_topic[in_topic]
    ]
    item[~in_topic] = planted.item_perm[_zipf(rng, planted.item_cdf, n - k)]

    # <recency-weighted mean latent of the last max_history_len items, latent of the
    # candidate>: the weighted mean of per-item dot products, summed per row with bincount.
    recent = age < data.max_history_len
    rows = row_of[recent]
    dots = np.einsum("md,md->m", planted.latent[history[recent]], planted.latent[item[rows]])
    weights = np.exp2(-age[recent] / _RECENCY_HALF_LIFE)
    weight_sums = np.maximum(np.bincount(rows, weights=weights, minlength=n), 1e-12)
    scale = _ALPHA / math.sqrt(gen.latent_dim)
    interaction = scale * np.bincount(rows, weights=weights * dots, minlength=n) / weight_sums
    kept = np.maximum(np.bincount(rows, minlength=n), 1)
    uniform = scale * np.bincount(rows, weights=dots, minlength=n) / kept

    logit = (
        _BIAS
        + dense.astype(np.float64) @ planted.w
        + _NONLINEAR * dense[:, 0] * dense[:, min(1, data.num_dense - 1)]
        + sum(b[cat[:, f]] for f, b in enumerate(planted.cat_bias))
        + planted.item_bias[item]
        + interaction
    )
    label = (rng.random(n) < sigmoid(logit)).astype(np.float32)
    columns = {
        "label": label,
        "dense": dense,
        "cat": cat,
        "item": item,
        "history_offsets": offsets,
        "history_values": history,
    }
    return columns, logit, interaction, uniform
