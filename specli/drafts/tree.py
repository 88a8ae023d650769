"""Draft trees, as llama-speculative drafts them: where the draft's next-token distribution has
a second candidate above --draft-p-split, the branch splits, up to --draft-n-seq branches; the
target verifies every node in one batch (a KV cell per node, tagged with the branches through
it) and the longest path it agrees with is kept."""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from specli.config import DraftPolicy, SamplingParams
from specli.verify import Dist, NonFinite, penalty_window, sampling_dist, transform

if TYPE_CHECKING:
    from specli.backend import Backend

ROOT = -1  # the parent of depth-1 nodes: the last committed token, not yet verified
_SPLIT_CANDIDATES = 8  # llama-speculative looks at the draft's top 8 for splits


@dataclass
class Tree:
    """Drafted nodes, parents before children. draws[ROOT] / draws[i]: the children of the
    root / of node i in the order the draft drew them (a child drawn twice appears twice: at
    temperature > 0 the draws are independent samples of q[...], and verification tries each
    draw in turn). q is None for deterministic children (greedy: the draft's top candidates)."""

    tokens: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)  # 1 for the root's children
    seqs: list[list[int]] = field(default_factory=list)  # the branches through each node
    draws: dict[int, list[int]] = field(default_factory=dict)
    q: dict[int, Dist] = field(default_factory=dict)  # the distribution node's children came from
    value: list[float] = field(default_factory=list)  # the path's estimated acceptance
    top: dict[int, tuple[float, int]] = field(default_factory=dict)  # node: (p1, top token)
    decoded: dict[int, int] = field(default_factory=dict)  # branch: nodes in the draft's cache
    source: str = "draft"

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix(self, n: int | None) -> Tree:
        """A chain's first n nodes (None: the whole chain)."""
        if n is None or n >= len(self):
            return self
        return Tree.chain(self.tokens[:n], [self.q[i - 1] for i in range(n)] if self.q else None,
                          self.source)

    @classmethod
    def chain(cls, tokens: Sequence[int], q: Sequence[Dist] | None = None,
              source: str = "") -> Tree:
        """A drafted sequence as a tree of one branch: node i's only child is node i + 1, and
        q[i] the distribution node i was drawn from (None: a deterministic proposal)."""
        n = len(tokens)
        return cls(list(tokens), list(range(-1, n - 1)), list(range(1, n + 1)), [[0]] * n,
                   {i - 1: [i] for i in range(n)},
                   {i - 1: d for i, d in enumerate(q)} if q else {}, source=source)

    @functools.cached_property
    def branched(self) -> bool:
        """Whether any node lives outside the committed branch (0): a chain never does
        (asked once the tree is drafted)."""
        return any(ss != [0] for ss in self.seqs)

    def add(self, parent: int, token: int, seq: int) -> int:
        """The child of `parent` spelling `token` (made in branch `seq` if new); records the
        draw either way."""
        draws = self.draws.setdefault(parent, [])
        node = next((c for c in draws if self.tokens[c] == token), None)
        if node is None:
            node = len(self.tokens)
            self.tokens.append(token)
            self.parent.append(parent)
            self.depth.append(1 if parent == ROOT else self.depth[parent] + 1)
            self.seqs.append([seq])
        draws.append(node)
        return node

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.parent[node]
        return out[::-1]

    @property
    def max_depth(self) -> int:
        return max(self.depth, default=0)

    @property
    def n_branches(self) -> int:
        """Its leaves: the paths the target may accept in full."""
        return max(1, len(self.tokens) - len({p for p in self.parent if p != ROOT}))

    @property
    def seq_ids(self) -> list[int]:
        """The sequences its nodes live in, 0 (the committed one) first."""
        return sorted({0, *(s for ss in self.seqs for s in ss)})

    def select(self, keep: set[int]) -> Tree:
        """The tree of the `keep` nodes (which hold every kept node's parent)."""
        index = {old: new for new, old in enumerate(i for i in range(len(self)) if i in keep)}
        index[ROOT] = ROOT
        out = Tree(source=self.source)
        for old in index:
            if old == ROOT:
                continue
            out.tokens.append(self.tokens[old])
            out.parent.append(index[self.parent[old]])
            out.depth.append(self.depth[old])
            out.seqs.append(list(self.seqs[old]))
            out.value.append(self.value[old])
        for parent, draws in self.draws.items():
            if parent in index:
                kept = [index[c] for c in draws if c in index]
                if kept:
                    out.draws[index[parent]] = kept
        out.q = {index[p]: q for p, q in self.q.items() if p in index}
        out.top = {index[p]: t for p, t in self.top.items() if p in index}
        out.decoded = dict(self.decoded)
        return out


class Calibration:
    """How often the target's greedy choice is the draft's top candidate, by the draft's own
    probability for it (ten bins, each starting from that probability as its prior): a
    draft's softmax is not its acceptance rate, and the tree ranks paths by acceptance."""

    BINS = 10

    def __init__(self) -> None:
        self.hits = np.zeros(self.BINS)
        self.seen = np.zeros(self.BINS)

    def _bin(self, p1: float) -> int:
        return min(int(p1 * self.BINS), self.BINS - 1)

    def top(self, p1: float) -> float:
        """The chance that the target takes the top candidate, when the draft gives it p1."""
        i = self._bin(p1)
        prior = (i + 0.5) / self.BINS
        return float((self.hits[i] + 2 * prior) / (self.seen[i] + 2))

    @property
    def mean(self) -> float:
        return float((self.hits.sum() + 1) / (self.seen.sum() + 2))

    def observe(self, p1: float, hit: bool) -> None:
        i = self._bin(p1)
        self.seen[i] += 1
        self.hits[i] += hit

    def record(self, tree: Tree, path: Sequence[int], token: int) -> None:
        """What the target chose at every node it reached whose children were drafted."""
        chosen = [*(tree.tokens[i] for i in path), token]
        for node, t in zip([ROOT, *path], chosen, strict=True):
            if node in tree.top:
                p1, best = tree.top[node]
                self.observe(p1, t == best)


@dataclass(eq=False)
class _Branch:
    seq: int
    node: int = ROOT  # its deepest node
    row: int = 0  # its row in the last draft decode
    drafting: bool = True
    decoded: int = 0  # how many of its nodes the draft's cache holds


def draft_tree(m: Backend, rows: np.ndarray, n_vocab: int, context: Sequence[int], k: int,
               sp: SamplingParams, rng: np.random.Generator, policy: DraftPolicy,
               calib: Calibration | None = None, source: str = "draft") -> Tree:
    """Up to k nodes over at most policy.n_seq branches of draft model m, from `rows` (its row
    after the context) on, a draft decode per depth for all the branches still drafting; a
    branch splits where its next candidates beyond the first are above p_split, and stops
    at p_min (its best candidate less likely) or at an end-of-generation token.

    Greedy, the k nodes are those most likely accepted, a path's chance estimated from the
    draft's probabilities calibrated by what the target chose before (`calib`; EAGLE-2
    ranks a dynamic tree by the draft's raw probabilities): a branch stops once it cannot
    beat the k-th best node drafted (or what a chain of k would reach at the calibrated
    mean), and the tree keeps the k best, so a confident draft keeps its whole depth and
    a doubtful one spreads. At
    temperature > 0, where the children must be independent draws whose number does not
    depend on what was drawn, the nodes are taken as drafted, up to k (llama-speculative)."""
    tree = Tree(source=source)
    branches = [_Branch(0)]
    n_past = len(context)  # the position of the depth-1 nodes
    tail = _tail(context, sp)
    best: list[float] = []  # the values of the nodes drafted, ascending (greedy)
    ranked = sp.greedy
    calib = calib or Calibration()
    chain = calib.mean ** k if ranked else 0.0  # a chain's k-th node, expected

    def floor(side: bool = True) -> float:  # what a node must beat to be among the k kept
        kth = best[-k] if ranked and len(best) >= k else 0.0
        return max(kth, chain) if side else kth

    room = m.n_ctx - len(context)  # cells the draft's cache has left for decoded nodes
    for depth in range(1, k + 1):
        new: list[_Branch] = []  # the branches that grew a node this depth
        for b in [b for b in branches if b.drafting]:
            v = tree.value[b.node] if b.node != ROOT else 1.0
            logits = rows[b.row][:n_vocab]
            if sp.transforms:
                logits = transform(logits, sp, [*tail, *(tree.tokens[i]
                                                          for i in tree.path(b.node))])
            cand, probs, q = _candidates(logits, sp, policy.p_split)
            if ranked:  # the chance each candidate is the target's choice
                a = calib.top(probs[0])
                rest = max(1.0 - probs[0], 1e-9)
                est = [a, *((1.0 - a) * p / rest for p in probs[1:])]
            else:
                est = probs
            full = not ranked and len(tree) >= k
            # a branch drafts while its next node can still be among the k kept (a side
            # branch, also while it beats what a chain of k would reach)
            if full or probs[0] < policy.p_min or v * est[0] <= floor(b.seq > 0):
                b.drafting = False
                continue
            if ranked:
                tree.top[b.node] = (probs[0], cand[0])
            n_split = 0  # llama-speculative: split while the next candidate is above p_split
            while (n_split + 1 < len(probs) and probs[n_split + 1] > policy.p_split
                   and len(branches) < policy.n_seq and v * est[n_split + 1] > floor()
                   and (ranked or len(tree) + n_split + 1 < k)):
                n_split += 1
                branches.append(_Branch(len(branches), b.node, b.row, True, b.decoded))
                m.fork(b.seq, branches[-1].seq)
                tree.decoded[branches[-1].seq] = b.decoded  # its copy of b's cells
            grown, parent = [b, *branches[len(branches) - n_split:]], b.node
            if q is not None:
                tree.q[parent] = q
            for i, br in enumerate(grown):
                token = cand[i] if q is None else q.sample(rng)
                node = tree.add(parent, token, br.seq)
                if node != len(tree) - 1 and br is not b:
                    # drawn again: the draw counts, the branch is not needed
                    br.drafting = False
                    continue
                tree.value.append(v * (est[i] if q is None else q.prob(token)))
                if ranked:
                    bisect.insort(best, tree.value[-1])
                _tag(tree, node, br.seq)
                br.node = node
                if m.is_eog(token):
                    br.drafting = False
                new.append(br)
        # a side branch costs the draft a wider decode per depth: greedy, it goes on only
        # while it is as likely as the first branch (else its alternatives stay leaves)
        lead = tree.value[branches[0].node] if branches[0].node != ROOT else 1.0
        grow = [b for b in new if b.drafting and depth < k and (ranked or len(tree) < k)
                and (b.seq == 0 or not ranked or tree.value[b.node] >= max(lead, floor()))]
        grow = grow[: max(0, room)]  # the draft's cells: its context, then the tree's nodes
        room -= len(grow)
        if not grow:
            break
        rows = m.decode_tree([tree.tokens[b.node] for b in grow],
                             [n_past + depth - 1] * len(grow), [[b.seq] for b in grow])
        for i, b in enumerate(grow):
            b.row, b.decoded = i, depth
            tree.decoded[b.seq] = depth
        for b in new:
            if b not in grow:
                b.drafting = False
    if len(tree) > k:  # greedy: the k most likely nodes (a parent is never less likely)
        order = sorted(range(len(tree)), key=lambda i: (-tree.value[i], tree.depth[i], i))
        tree = tree.select(set(order[:k]))
    return tree


def _tag(tree: Tree, node: int, seq: int) -> None:
    """Branch `seq` passes through `node` and all its ancestors."""
    while node != ROOT:
        if seq not in tree.seqs[node]:
            tree.seqs[node].append(seq)
        node = tree.parent[node]


def _candidates(logits: np.ndarray, sp: SamplingParams, p_split: float
                ) -> tuple[list[int], list[float], Dist | None]:
    """The draft's best candidate, then those above p_split (the only ones a branch can
    take), most likely first, with their probabilities (greedy: its softmax over the whole
    vocabulary), and at temperature > 0 the distribution q the children are drawn from."""
    if sp.greedy:
        best = int(np.argmax(logits))
        e = np.exp(logits - logits[best])  # float32: half the time of float64, on every depth
        denom = float(e.sum(dtype=np.float64))
        if not np.isfinite(logits[best]) or not np.isfinite(denom):  # NaN or infinity
            raise NonFinite(-1)
        split = np.flatnonzero(e > p_split * denom)
        split = split[split != best]
        split = split[np.argsort(-e[split], kind="stable")][: _SPLIT_CANDIDATES - 1]
        cand = [best, *split.tolist()]
        return cand, (e[cand] / denom).tolist(), None
    q = sampling_dist(logits, sp)
    return q.ids[:_SPLIT_CANDIDATES].tolist(), q.probs[:_SPLIT_CANDIDATES].tolist(), q


def _tail(context: Sequence[int], sp: SamplingParams) -> list[int]:
    return list(penalty_window(context, sp)) if sp.transforms else []
