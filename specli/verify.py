"""Acceptance rules over numpy arrays: greedy token match and speculative rejection sampling.

Pure functions: no llama.cpp, no I/O. `Dist` is a sparse probability distribution (the support
left after top-k/top-p/min-p), so nothing here allocates a vocabulary-sized array per token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from specli.config import SamplingParams


class NonFinite(ArithmeticError):
    """A logits row holding NaN or infinity (damaged weights, a broken backend): no token can
    be chosen from it. `row` is its index in the verification batch (-1: a draft's row)."""

    def __init__(self, row: int = -1):
        super().__init__(f"non-finite logits in row {row}")
        self.row = row


def finite_argmax(row: np.ndarray, index: int = -1) -> int:
    """The row's argmax, after checking the row is usable: numpy's argmax lands on a NaN or
    an infinity if there is one, so one look at the winner checks the whole row."""
    best = int(row.argmax())
    if not math.isfinite(row[best]):
        raise NonFinite(index)
    return best


def finite_argmaxes(rows: np.ndarray, index: int = -1) -> list[int]:
    """finite_argmax of each row of a 2-D array, in one numpy call (a drafted block's rows:
    a call per row costs more than the argmax of so few rows)."""
    best = rows.argmax(axis=1)
    if not np.isfinite(rows[np.arange(len(best)), best]).all():
        raise NonFinite(index)
    return best.tolist()


@dataclass(frozen=True)
class Dist:
    """Token ids and their probabilities, probabilities summing to 1, highest first."""

    ids: np.ndarray
    probs: np.ndarray

    def prob(self, token: int) -> float:
        hit = np.flatnonzero(self.ids == token)
        return float(self.probs[hit[0]]) if hit.size else 0.0

    def sample(self, rng: np.random.Generator) -> int:
        """One draw, the cumulative mass laid out in token-id order, not by probability: two
        nearly tied tokens whose order a batched decode's rounding swaps (F16: logits move by
        a few hundredths) then move a draw only if it falls in the sliver of mass that moved,
        so a seed gives the same token however the row was decoded (exact verification)."""
        order = np.argsort(self.ids, kind="stable")
        cdf = np.cumsum(self.probs[order])
        i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
        return int(self.ids[order[min(i, order.size - 1)]])


def penalty_window(context: Sequence[int], sp: SamplingParams) -> Sequence[int]:
    """The tokens of `context` the repetition penalties look at: its last repeat_last_n
    (-1: all of it; 0: none)."""
    n = sp.repeat_last_n
    return context if n < 0 else context[-n:] if n > 0 else ()


def transform(logits: np.ndarray, sp: SamplingParams, history: Sequence[int]) -> np.ndarray:
    """The row as llama.cpp's chain sees it before top-k: logit bias added, then the
    repetition penalties for the tokens among the last repeat_last_n of `history` (a logit
    <= 0 is multiplied by repeat_penalty, a positive one divided; then count * frequency +
    presence subtracted). The row itself when nothing applies, else a copy; applied alike
    to target and draft rows, so acceptance targets the transformed distribution."""
    if not sp.transforms:
        return logits
    row = logits.copy()
    for token, bias in sp.logit_bias:
        if token < row.shape[0]:
            row[token] += bias
    if sp.penalized and history:
        window = history[-sp.repeat_last_n:] if sp.repeat_last_n > 0 else history
        ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
        counts, ids = counts[ids < row.shape[0]], ids[ids < row.shape[0]]
        z = row[ids]
        z = np.where(z <= 0, z * sp.repeat_penalty, z / sp.repeat_penalty)
        row[ids] = z - (counts * sp.frequency_penalty + sp.presence_penalty)
    if not np.isfinite(row.max()) and np.isfinite(logits.max()):
        raise TransformError("the request's logit bias and penalties leave no finite logit "
                             "(a penalty too close to 0, or too large)")
    return row


class TransformError(ValueError):
    """A request's transform turned a usable row into one no token can be chosen from."""


class NoToken(ValueError):
    """The grammar allows no token at this position."""


def grammar_mask(logits: np.ndarray, allowed: Callable[[np.ndarray], np.ndarray],
                 need: int) -> np.ndarray:
    """The row with every token -inf but the `need` highest the grammar allows: what the
    chain's top-k keeps after llama.cpp's grammar sampler masked the row first (need 1 for
    greedy, the whole vocabulary when top-k is off). Candidates are asked in descending
    order, a growing chunk at a time: usually the first chunk holds them."""
    n = logits.shape[0]
    out = np.full(n, -np.inf, dtype=logits.dtype)
    seen = np.zeros(n, dtype=bool)
    found, m = 0, 0
    while found < need and m < n:
        m = min(n, max(64, 8 * m))
        top = np.argpartition(-logits, m - 1)[:m] if m < n else np.arange(n)
        top = top[~seen[top]]
        top = top[np.argsort(-logits[top], kind="stable")]
        seen[top] = True
        ok = top[allowed(top)][: need - found]
        out[ok] = logits[ok]
        found += ok.size
    if not found:
        raise NoToken("the grammar allows no token here")
    return out


def need_for(sp: SamplingParams, n_vocab: int) -> int:
    """How many of the grammar's best tokens the chain can keep: 1 greedy, else top-k."""
    return 1 if sp.greedy else sp.top_k if 0 < sp.top_k < n_vocab else n_vocab


def sampling_dist(logits: np.ndarray, sp: SamplingParams, index: int = -1) -> Dist:
    """llama.cpp's default chain on one logits row: top-k, top-p, min-p, then temperature.
    NonFinite(index) for a row with NaN or no finite maximum: numpy partitions NaN to the
    top, so looking at the k kept is looking at the whole row."""
    n = logits.shape[0]
    k = sp.top_k if 0 < sp.top_k < n else n
    ids = np.argpartition(logits, n - k)[n - k :] if k < n else np.arange(n)
    ids = ids[np.argsort(-logits[ids], kind="stable")]
    z = logits[ids].astype(np.float64)
    if np.isnan(z).any() or not np.isfinite(z[0]):
        raise NonFinite(index)
    p = np.exp(z - z[0])
    p /= p.sum()
    if sp.top_p < 1.0:  # keep the smallest prefix whose mass reaches top_p
        keep = int(np.searchsorted(np.cumsum(p), sp.top_p)) + 1
        ids, z, p = ids[:keep], z[:keep], p[:keep]
    if sp.min_p > 0.0:  # drop tokens below min_p times the top probability
        keep = int(np.count_nonzero(p >= sp.min_p * p[0]))
        ids, z = ids[: max(keep, 1)], z[: max(keep, 1)]
    p = np.exp((z - z[0]) / sp.temp)
    return Dist(ids, p / p.sum())


def residual(p: Dist, q: Dist | None, drafted: int) -> Dist:
    """norm(max(0, p - q)); q None means a one-hot proposal of `drafted`."""
    r = p.probs.copy()
    if q is None:
        r[p.ids == drafted] = 0.0
    else:
        common, ip, iq = np.intersect1d(p.ids, q.ids, assume_unique=True, return_indices=True)
        r[ip] = np.maximum(0.0, r[ip] - q.probs[iq])
    total = r.sum()
    if total <= 0.0:  # p == q: any p-sample is right, and drafted was rejected with prob 0
        return p
    return Dist(p.ids, r / total)


class _Chain(NamedTuple):
    """One drafted sequence in the shape verify_tree walks: node i's only child is i + 1."""

    tokens: Sequence[int]
    draws: dict[int, list[int]]
    q: dict[int, Dist]


def verify(
    drafted: Sequence[int],
    q: Sequence[Dist] | None,
    target_row: Callable[[int], np.ndarray],
    sp: SamplingParams,
    rng: np.random.Generator,
    exact: bool = False,
) -> tuple[int, int]:
    """Return (accepted count, next token) for one drafted sequence: verify_tree on a tree of
    one branch, q[i] the distribution drafted[i] was drawn from (None: deterministic).
    `target_row(i)` gives logits row i lazily."""
    chain = _Chain(drafted, {i - 1: [i] for i in range(len(drafted))},
                   {i - 1: d for i, d in enumerate(q)} if q else {})
    path, token = verify_tree(chain, lambda r, _: target_row(r), sp, rng, exact)
    return len(path), token


@dataclass(frozen=True)
class TokenProbs:
    """A chosen token's probability and the n most likely tokens (id, probability) at its
    position, highest first."""

    token: int
    prob: float
    top: tuple[tuple[int, float], ...]


def token_probs(logits: np.ndarray, token: int, n: int) -> TokenProbs:
    """From a raw row: the model's own softmax over the whole vocabulary."""
    z = logits.astype(np.float64)
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    n = min(n, p.shape[0])
    top = np.argpartition(-p, n - 1)[:n] if n > 0 else np.empty(0, dtype=np.int64)
    top = top[np.argsort(-p[top], kind="stable")]
    return TokenProbs(token, float(p[token]), tuple((int(i), float(p[i])) for i in top))


def sampled_probs(d: Dist, token: int, n: int) -> TokenProbs:
    """After the chain: the distribution the token was drawn from (zeros left out)."""
    keep = [(int(i), float(q)) for i, q in zip(d.ids[:n], d.probs[:n], strict=True) if q > 0]
    return TokenProbs(token, d.prob(token), tuple(keep))


def verify_tree(tree, target_row: Callable[[int, list[int]], np.ndarray], sp: SamplingParams,
                rng: np.random.Generator, exact: bool = False) -> tuple[list[int], int]:
    """Return (the accepted path's nodes, next token) for a draft tree (drafts/tree.py), whose
    node i is row i + 1 of the verification batch (row 0: the root); a drafted sequence is a
    tree of one branch.

    Walk down from the root. Greedy: descend into the child spelling the target's argmax.
    Sampling (SpecInfer's multi-draft rule): try the node's draws in order, accepting draw x
    with probability min(1, r(x)/q(x)), where r starts as p and becomes norm(max(0, r - q))
    after each rejection; when every draw is rejected, sample r. With independent draws from
    q this draws from p exactly; a one-hot q (greedy children, n-gram drafts) zeroes x
    instead. On one branch this is Leviathan et al.'s rule: accept x with min(1, p(x)/q(x)),
    on rejection sample norm(max(0, p - q)), after a full acceptance the bonus row.
    Exact (llama-server's rule): sample p itself at each node and descend into the child
    spelling the sample: one draw per emitted token, as without a draft, so a seed gives the
    same tokens with or without one (q is not used: drafts are greedy there).
    `target_row(row, path)` gives the batch row, `path` the nodes above it."""
    path: list[int] = []
    node = -1
    while True:
        row = target_row(node + 1, path)
        draws = tree.draws.get(node, [])
        if sp.greedy:
            best = finite_argmax(row, node + 1)
            for c in draws:
                if tree.tokens[c] == best:
                    node = c
                    path.append(c)
                    break
            else:
                return path, best
            continue
        r = sampling_dist(row, sp, node + 1)
        if exact:
            x = r.sample(rng)
            node = next((c for c in draws if tree.tokens[c] == x), None)
            if node is None:
                return path, x
            path.append(node)
            continue
        q = tree.q.get(node)
        for c in draws:
            x = tree.tokens[c]
            qx = q.prob(x) if q is not None else 1.0
            if qx > 0.0 and rng.random() * qx < r.prob(x):
                path.append(c)
                node = c
                break
            r = residual(r, q, x)
        else:
            return path, r.sample(rng)


def path_probs(rows: np.ndarray, row: Callable[[int, list[int]], np.ndarray], tree,
               path: list[int], token: int, sp: SamplingParams,
               is_eog: Callable[[int], bool]) -> list[TokenProbs]:
    """The probabilities of each token a step emits (the accepted path, then `token`), from
    the rows verify_tree used: exactly the target's at each emitted position. rows: the
    raw batch; row(r, path): row r as the sampler saw it. End-of-generation tokens have
    none."""
    out = []
    for i, t in enumerate([*(tree.tokens[j] for j in path), token]):
        if is_eog(t):
            continue
        r = 0 if i == 0 else path[i - 1] + 1
        if not sp.post_sampling_probs:  # the raw row's softmax
            out.append(token_probs(rows[r], t, sp.n_probs))
        elif sp.greedy:  # the greedy chain keeps one token
            out.append(TokenProbs(t, 1.0, ((t, 1.0),) if sp.n_probs else ()))
        else:  # the distribution the chain drew from
            out.append(sampled_probs(sampling_dist(row(r, path[:i]), sp, r), t, sp.n_probs))
    return out
