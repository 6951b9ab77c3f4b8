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

from typing import List, Tuple

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
