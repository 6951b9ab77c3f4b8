"""A generated click log for the CTR example (train_ctr_torch.py), and the AUC it reports.

Each example has 26 categorical features (one id per table) and 13 dense ones. Ids follow a
Zipf law (exponent ``ZIPF`` = 1.1): id 0 of a table is its hottest row, as in a vocabulary
sorted by frequency. The label is drawn from a planted model: a logistic function of
per-row weights, dot products of planted per-row vectors between pairs of tables, and a
linear function of the dense features. The planted values of a row are a hash of (seed,
table, row), so a table of 10^6 or 10^8 rows costs nothing until a row is drawn, and every
process that generates the log (each worker, ``--local``) sees the same examples.

numpy only: shared by the example and its tests (python/tests/test_examples.py).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

#: Categorical features (embedding tables) and dense features, as in Criteo's click logs.
N_SPARSE, N_DENSE = 26, 13
#: Exponent of the Zipf law of the ids.
ZIPF = 1.1
#: Dimension of the planted per-row vectors.
PLANTED_DIM = 4
#: The planted logit's bias (about a quarter of the examples are clicks).
BIAS = -1.2


def table_sizes(rows_scale: float = 1.0) -> List[int]:
    """Rows of the 26 tables: log-spaced from 10^3 to 10^6, times ``rows_scale`` (at least 2)."""
    exps = np.linspace(3.0, 6.0, N_SPARSE)
    return [max(2, int(round(10**e * rows_scale))) for e in exps]


def zipf_ids(rng: np.random.Generator, rows: int, n: int, s: float = ZIPF) -> np.ndarray:
    """``n`` ids in ``0..rows`` with P(id = k) about proportional to (k + 1)^-s: the inverse
    CDF of the continuous power law on [1, rows + 1), rounded down (O(n), whatever ``rows``)."""
    u = rng.random(n)
    a = 1.0 - s
    x = (1.0 + u * ((rows + 1.0) ** a - 1.0)) ** (1.0 / a)
    return np.minimum(np.floor(x).astype(np.int64) - 1, rows - 1)


def _hash(seed: int, table: int, rows: np.ndarray, salt: int) -> np.ndarray:
    """splitmix64 of (seed, table, row, salt): uniform uint64 per row."""
    with np.errstate(over="ignore"):
        z = rows.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z ^= np.uint64((seed * 1_000_003 + table * 8191 + salt * 131) & 0xFFFFFFFFFFFFFFFF)
        z += np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def planted_uniform(seed: int, table: int, rows: np.ndarray, salt: int) -> np.ndarray:
    """Uniform values in [-1, 1), one per row, a pure function of (seed, table, row, salt)."""
    h = _hash(seed, table, rows, salt) >> np.uint64(11)  # 53 bits
    return h.astype(np.float64) * (2.0 / 2.0**53) - 1.0


def planted_logit(seed: int, ids: np.ndarray, dense: np.ndarray) -> np.ndarray:
    """The planted model's logit of each example (``ids``: (n, 26) int64; ``dense``: (n, 13))."""
    n = len(ids)
    first = np.zeros(n)
    vecs = []
    for t in range(N_SPARSE):
        first += planted_uniform(seed, t, ids[:, t], 0)
        vecs.append(np.stack([planted_uniform(seed, t, ids[:, t], 1 + k) for k in range(PLANTED_DIM)], 1))
    # Each uniform has variance 1/3; scale every part to about unit variance.
    first /= np.sqrt(N_SPARSE / 3.0)
    half = N_SPARSE // 2
    pairs = sum((vecs[t] * vecs[t + half]).sum(1) for t in range(half))
    pairs /= np.sqrt(half * PLANTED_DIM / 9.0)
    w = np.random.default_rng(seed + 7).normal(size=N_DENSE) / np.sqrt(N_DENSE)
    return BIAS + 1.2 * first + 1.0 * pairs + 0.8 * (dense @ w)


def click_log(seed: int, n: int, sizes: List[int], part: int = 0) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` examples: ids (n, 26) int64, dense features (n, 13) float32, labels (n,) float32.
    ``part`` draws an independent log of the same planted model (0: training, 1: test)."""
    rng = np.random.default_rng([seed, part])
    ids = np.stack([zipf_ids(rng, rows, n) for rows in sizes], 1)
    dense = rng.normal(size=(n, N_DENSE))
    p = 1.0 / (1.0 + np.exp(-planted_logit(seed, ids, dense)))
    labels = (rng.random(n) < p).astype(np.float32)
    return ids, dense.astype(np.float32), labels


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve: the probability that a random positive scores above a
    random negative, ties counting one half (the Mann-Whitney rank statistic, ties given
    their average rank). NaN when one class is missing."""
    labels = np.asarray(labels).ravel() > 0.5
    scores = np.asarray(scores, dtype=np.float64).ravel()
    if labels.shape != scores.shape:
        raise ValueError(f"auc: {labels.size} labels but {scores.size} scores")
    pos = int(labels.sum())
    neg = labels.size - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    # Ranks 1..n, each run of equal scores given the mean of its ranks.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], scores.size]
    avg = (starts + ends + 1) / 2.0  # mean of ranks starts+1 .. ends
    ranks = np.empty(scores.size)
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[labels].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


# -- A drifting stream of hashed feature ids (train_stream_ctr.py) ----------------------

#: Fields (categorical features) of the stream's examples.
STREAM_FIELDS = 8
#: Probability that a draw takes an older generation of its slot (the fade of old items).
STREAM_FADE = 0.3


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer of uint64 values (a bijection)."""
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


class ClickStream:
    """An endless click stream whose id population drifts, as a recommender's does.

    Each example has ``fields`` categorical features, each a hashed 64-bit id (any int64
    value, negative ones included). A field's ids live in ``live`` slots with Zipf
    popularity (exponent ``zipf``: slot 0 is the hottest). A slot holds one item at a
    time, replaced by a new item every ``life`` steps or so (each slot with its own period,
    from 0.5 to 1.5 times ``life``, and phase): new items appear at every popularity, and
    a draw takes the slot's previous items with probability ``STREAM_FADE`` each (1, 2, ...
    generations back), so an old item fades rather than vanishes. Over ``steps`` steps a
    field's slots hold about ``live * (steps / life + 1)`` items: ``for_distinct`` picks
    ``life`` for a total number of distinct ids over the run.

    Labels come from a hidden model: a logistic function of per-item weights and of dot
    products of per-item planted vectors between pairs of fields, all a hash of (seed,
    field, item), so a new item brings new values that a model must learn. The examples
    of step ``step`` are a pure function of (seed, step, part, rank): every process sees
    the same stream, and ``part=1`` draws a test set from the same population.
    """

    def __init__(self, seed: int = 0, live: int = 100_000, life: float = 200.0, fields: int = STREAM_FIELDS, zipf: float = ZIPF):
        if live < 1 or life <= 0 or fields < 2:
            raise ValueError("ClickStream: live >= 1, life > 0 and fields >= 2")
        self.seed, self.live, self.life, self.fields, self.zipf = seed, int(live), float(life), int(fields), zipf

    @classmethod
    def for_distinct(cls, distinct_ids: int, steps: int, live: Optional[int] = None, **kw) -> "ClickStream":
        """A stream whose slots hold about ``distinct_ids`` items (all fields) over ``steps``
        steps: ``live`` slots per field (default: a tenth of a field's share, at least 1000),
        ``life`` set to match."""
        fields = kw.get("fields", STREAM_FIELDS)
        per_field = max(1, distinct_ids // fields)
        live = live or max(1000, per_field // 10)
        items_per_slot = max(per_field / live, 1.0 + 1e-9)
        life = steps / (items_per_slot - 1.0) if items_per_slot > 1.0 else 1e12
        return cls(live=live, life=max(life, 1.0), **kw)

    def items(self, field: int, slots: np.ndarray, step: int, back: np.ndarray) -> np.ndarray:
        """The item (slot, generation) keys of ``slots`` at ``step``, ``back`` generations back."""
        u = planted_uniform(self.seed, 1000 + field, slots, 0)  # [-1, 1): the slot's period and phase
        period = self.life * (1.0 + 0.5 * u)
        phase = (u + 1.0) * 0.5 * period * 7.0
        gen = np.floor((step + phase) / period).astype(np.int64) - back
        return slots.astype(np.uint64) << np.uint64(24) ^ gen.astype(np.uint64)

    def ids(self, field: int, items: np.ndarray) -> np.ndarray:
        """The hashed 64-bit ids (int64) of ``items`` of ``field``."""
        salt = np.uint64((self.seed * 0x100000001B3 + field * 0x9E3779B1 + 17) & 0xFFFFFFFFFFFFFFFF)
        return _mix(items ^ salt).view(np.int64)

    def batch(self, step: int, n: int, part: int = 0, rank: int = 0) -> Tuple[np.ndarray, np.ndarray]:
        """``n`` examples of step ``step``: ids (n, fields) int64 and labels (n,) float32."""
        rng = np.random.default_rng([self.seed, part, rank, step])
        ids = np.empty((n, self.fields), np.int64)
        items = []
        for f in range(self.fields):
            slots = zipf_ids(rng, self.live, n, self.zipf)
            back = rng.geometric(1.0 - STREAM_FADE, n) - 1
            it = self.items(f, slots, step, back)
            items.append(it)
            ids[:, f] = self.ids(f, it)
        p = 1.0 / (1.0 + np.exp(-self.logit(items)))
        return ids, (rng.random(n) < p).astype(np.float32)

    def logit(self, items: List[np.ndarray]) -> np.ndarray:
        """The hidden model's logit of examples given their items per field."""
        first = sum(planted_uniform(self.seed, f, it, 0) for f, it in enumerate(items))
        first = first / np.sqrt(self.fields / 3.0)
        vecs = [np.stack([planted_uniform(self.seed, f, it, 1 + k) for k in range(PLANTED_DIM)], 1) for f, it in enumerate(items)]
        half = self.fields // 2
        pairs = sum((vecs[f] * vecs[f + half]).sum(1) for f in range(half)) / np.sqrt(half * PLANTED_DIM / 9.0)
        return -1.0 + 1.5 * first + 1.0 * pairs


def stream_batches(seed: int, distinct_ids: int, steps: int, batch_size: int, part: int = 0, rank: int = 0):
    """The stream's batches for a run: ``(step, ids, labels)`` for ``step`` in ``0..steps``,
    from ``ClickStream.for_distinct(distinct_ids, steps)``."""
    stream = ClickStream.for_distinct(distinct_ids, steps, seed=seed)
    for step in range(steps):
        ids, labels = stream.batch(step, batch_size, part, rank)
        yield step, ids, labels
