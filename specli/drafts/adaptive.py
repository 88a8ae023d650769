"""`--draft auto`: choose the draft length k each step from measured acceptance and cost.

A draft of k tokens yields E(k) = 1 + S(1) + ... + S(k) tokens per step, where S(j) is the
chance that its first j tokens are all accepted, at the cost of drafting k tokens plus
verifying k + 1. Everything is measured online: S(j) per source as a product of per-position
acceptance rates (no independence assumed: an n-gram match tends to be right all the way or
wrong at once), drafting time per token per source, and the target's verification time as a
linear function of the batch size (shared by all sources). k is the argmax of E(k) / cost(k),
and 0 where no length beats the target alone (a draft as slow as its target, or one it
rarely agrees with): the step decodes plainly, and now and then a short draft keeps the
estimates alive.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from specli.config import DRAFT_AUTO_MAX, DraftPolicy, SamplingParams
from specli.drafts.base import Decoded, DraftSource, Outcome, Reads
from specli.drafts.tree import Tree

if TYPE_CHECKING:
    from specli.rules import Rules

DECAY = 0.95  # weight of the past per observation: about the last 20 steps count
# the prior cost of each extra token in a verification batch, relative to a batch of one
# (about 0.1 for SmolLM2 F32 on 2 CPU cores, 0.2-0.4 for larger models); measured thereafter
PRIOR_SLOPE = 0.15
PRIOR_WEIGHT = 4.0
# a decode of one token costs the median of the last ONES timed (not a decayed mean: while
# drafting they are rare, and one timed while the machine was busy, 1.8x too dear, priced the
# next hundred steps of `run --draft auto`)
ONES = 5
EXPLORE = 0.1  # share of the plans that try k +- 1 (every slot), so other lengths stay known
# where no draft pays (k = 0), the share of the target's time alone that exploring steps
# may cost, so that acceptance and cost stay known: a step drafts again once the plain steps
# since the last draft have earned its cost (its catch-up of what the draft missed, its draft
# and the longer verification). Where even a draft always right would not pay (one as slow
# as its target), only the first step of a generation drafts, its cache fresh from the prompt
EXPLORE_REST = 0.04
# a draft that missed plain steps decodes what it missed before it drafts again (its
# catch-up): the plan counts that time spread over the steps its estimates look ahead to,
# about the last 1 / (1 - DECAY) = 20 (a switch to drafting must pay for itself within them)
HORIZON = 1.0 / (1.0 - DECAY)
COLD_K = 2  # the longest draft before the draft's time a token is measured
PRIOR_STEPS = 2.0  # the weight, in steps, of the acceptance assumed before any is measured
# plain steps a source alone takes, its second step on, until PROBES decodes of one token are
# timed (the engine's timer times each; where no engine times, a test's fake, no more); then
# again once EXPLORE_REST of the verifications' time since the last has earned one
PROBES = 3


class VerifyCost:
    """t(n) = a * (1 + s * (n - 1)) seconds to verify a batch of n tokens, fitted online: the
    verification half of the CostModel (cost.py) that --draft auto decides with.

    A decode of one token is kept apart (`one`, a median of the last few): llama.cpp decodes
    a single token with matrix-vector kernels and a batch with matrix products, so the cost
    jumps from n = 1 to n = 2. Measured on the F16 SmolLM2 (2 threads), a line through
    verifications of 8-10 tokens read t(1) 1.4-1.6x too dear, and drafting looked to win
    where it lost (one thread: a verification of 3 tokens costs 3x a plain step)."""

    def __init__(self) -> None:
        self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._ones: deque[float] = deque(maxlen=ONES)
        self._since = 0.0  # the seconds of longer decodes since the last decode of one
        self.version = 0  # the line's: how many longer decodes it is fitted through
        self._lock = threading.Lock()  # (a server's slots and decodes share one loop's thread)

    def add(self, n: int, seconds: float) -> None:
        with self._lock:
            if n <= 1:
                self._ones.append(seconds)
                self._since = 0.0
                return
            self._since += seconds
            self.version += 1
            x = n - 1
            for name in ("_w", "_sx", "_sy", "_sxx", "_sxy"):
                setattr(self, name, getattr(self, name) * DECAY)
            self._w += 1
            self._sx += x
            self._sy += seconds
            self._sxx += x * x
            self._sxy += x * seconds

    def known(self) -> bool:
        with self._lock:
            return self._w > 0 or bool(self._ones)

    def one(self) -> float | None:
        """The measured seconds for a decode of one token (None: none measured yet)."""
        with self._lock:
            return statistics.median_low(self._ones) if self._ones else None

    def n_one(self) -> int:
        """How many decodes of one token the median is of."""
        with self._lock:
            return len(self._ones)

    def since_one(self) -> float:
        """The seconds of longer decodes since a decode of one token was last timed."""
        with self._lock:
            return self._since

    def at(self, n: int) -> float:
        """The fitted seconds for a decode of n tokens (one token's as measured; a longer
        decode never cheaper than that)."""
        a, slope = self.fit()
        one = self.one()
        line = a * (1 + slope * (n - 1))
        return line if one is None else one if n <= 1 else max(line, one)

    def fit(self) -> tuple[float, float]:
        """(a, slope) of the line through the decodes of more than one token, the slope
        shrunk towards the prior when the batch sizes barely vary; before any such decode,
        one token's time at the prior slope."""
        with self._lock:
            w, sx, sy, sxx, sxy = self._w, self._sx, self._sy, self._sxx, self._sxy
            one = statistics.median_low(self._ones) if self._ones else 0.0
        if w == 0:
            return one, PRIOR_SLOPE
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        cov = sxy / w - mx * my
        # least squares for the slope b in y = a + b x, shrunk towards the prior's slope
        a_prior = my / (1 + PRIOR_SLOPE * mx)
        b = (cov * w + PRIOR_WEIGHT * PRIOR_SLOPE * a_prior) / (var * w + PRIOR_WEIGHT)
        b = max(b, 0.0)  # a longer decode never costs less (noise can say so: not a = 3 t)
        a = max(my - b * mx, 1e-9)
        return a, b / a


class CatchUp:
    """Seconds a token of a draft's catch-up (the tokens it missed, decoded in one batch),
    decayed; the catch-ups of one iteration are one decode (a server's slots, combined)."""

    def __init__(self) -> None:
        self._s = self._n = 0.0
        self._now: list[tuple[int, float]] = []  # this iteration's: (tokens, seconds)

    def add(self, n: int, seconds: float) -> None:
        self._now.append((n, seconds))

    def fold(self) -> None:
        """(at an iteration's end) the iteration's catch-ups as one decode: every slot's
        clock saw the one combined decode, of all their tokens."""
        if self._now:
            self._s = DECAY * self._s + max(s for _, s in self._now)
            self._n = DECAY * self._n + sum(n for n, _ in self._now)
            self._now = []

    def known(self) -> bool:
        return self._n > 0

    def rate(self, c: float) -> float:
        """Seconds a token; before any is measured, a drafted token's c at the prior
        batch slope (a token in a batch costs about that share of a decode of one)."""
        return self._s / self._n if self._n else c * PRIOR_SLOPE


class Batch:
    """The slots whose verifications share one target decode (a server's, batching.py; `run`
    is a batch of one): the target's time for a decode of n tokens in all (cost: fed where
    the decodes are made, in a server), and each drafting slot's acceptance curve S(j) and
    drafting time a token, as of its last step. Each slot takes its k from one plan for the
    whole batch (plan_batch, one length for all): a slot alone cannot see that its draft is
    free only because the others draft too, and every slot drafting was the plan none of
    them would choose."""

    def __init__(self, cost: VerifyCost | None = None, seed: int = 0) -> None:
        self.cost = cost or VerifyCost()
        self._rng = np.random.default_rng(seed)  # exploration only: never the output
        self.catch_up = CatchUp()
        # a server's draft model: its decode of one position of n slots side by side, timed
        # by its shared context (a slot's own clock saw the decode of the slots drafting at
        # its last proposal, which under load were many: 8 slots' one token costs about
        # what the target's does, and a slot left alone would read that as its own)
        self.draft = VerifyCost()
        self._curves: dict[object, tuple[np.ndarray, float, int, bool]] = {}
        self._lock = threading.Lock()
        self._plan_k: dict[object, int] = {}  # the plan made this iteration
        self._asked: set[object] = set()  # the slots that have taken their k from it

    def choose(self, who: object, s: np.ndarray, c: float, behind: int = 0,
               shared: bool = False) -> int:
        """who's k in the batch's best plan, its S(j) for j = 1..its cap being s, its
        draft c seconds a token as it last measured (shared: a draft model of the batch's
        shared context, whose time for the slots side by side is `draft`'s line, once
        measured) and `behind` tokens short of its context (its catch-up).
        The plan is made once an iteration (when a slot asks again, or one it does not
        know): the slots step one after another, each with the others' curves as of their
        last step."""
        with self._lock:
            self._curves[who] = (s, c, behind, shared)
            if who in self._asked or who not in self._plan_k:
                self.catch_up.fold()
                whos = list(self._curves)
                ks = self._ks()
                if ks.max() > 0 and self._rng.random() < EXPLORE:  # the lengths around
                    # the plan's stay measured: every slot one longer or shorter at once
                    # (one slot alone a length apart would make a decode of unequal lengths)
                    ks = np.where(ks > 0, np.maximum(ks + self._rng.choice((-1, 1)), 1), 0)
                self._plan_k = dict(zip(whos, ks.tolist(), strict=True))
                self._asked = set()
            self._asked.add(who)
            return self._plan_k[who]

    def could(self, who: object) -> bool:
        """Whether who would draft if its draft were always right (if not, nothing it could
        learn would make it pay)."""
        return self._plan(who, right=True) > 0

    def _plan(self, who: object, right: bool = False) -> int:
        with self._lock:
            mine = list(self._curves).index(who)
            return int(self._ks(mine if right else -1)[mine])

    def _ks(self, right: int = -1) -> np.ndarray:
        """(under the lock) Every slot's k in the best plan; slot `right`'s draft always
        right."""
        curves = list(self._curves.values())
        t1, slope = self.cost.fit()
        S = np.zeros((len(curves), max(len(cs) for cs, *_ in curves)))
        for i, (cs, *_) in enumerate(curves):
            S[i, :len(cs)] = 1.0 if i == right else cs
        # the slots draft side by side: the slowest, the shared draft model's time for all
        # of them where measured
        line = self.draft.at(len(curves)) if self.draft.known() else None
        c = max(line if shared and line is not None else ci for _, ci, _, shared in curves)
        behind = np.array([b for _, _, b, _ in curves], dtype=float)
        # before the target's decode is timed, it is priced at the draft's time a token (as
        # slow as its target: the batch decodes plainly, and times it); at 1 s, the first
        # requests of a server drafted up to 64 tokens a step blind (0.8 s for two slots')
        t1 = t1 or c or 1.0
        return plan_batch(S, t1, slope, c, behind, self.catch_up.rate(c), self.cost.one())

    def join(self, who: object, c: float, shared: bool = False) -> None:
        """who's generation starts: a member of the batch's decodes from its first step,
        which drafts nothing (a server slot's first token is the target's alone), so that
        no slot beside it plans as if alone (4 requests starting together: the first to ask
        drafted 13 tokens beside three plain steps, a decode of unequal lengths)."""
        with self._lock:
            self._curves[who] = (np.zeros(0), c, 0, shared)
            self._plan_k, self._asked = {}, set()

    def drop(self, who: object) -> None:
        with self._lock:
            self._curves.pop(who, None)
            self._plan_k, self._asked = {}, set()  # a new plan without it

    def members(self) -> int:
        with self._lock:
            return len(self._curves)


def plan_batch(S: np.ndarray, t1: float, slope: float, c: float,
               behind: np.ndarray | None = None, p: float = 0.0,
               one: float | None = None) -> np.ndarray:
    """Each slot's draft length for the most tokens a second of the whole batch (SmartSpec's
    goodput), 0 included: one length k for every slot (a slot's cap, where lower). S[i, j - 1]:
    the chance that slot i's first j drafted tokens are accepted (non-increasing in j; 0 past
    its cap). A step drafts k positions (the slots side by side, c seconds each), then
    verifies every slot's k_i + 1 tokens in one decode of t1 * (1 + slope * (n - 1)) seconds,
    and yields the sum of 1 + S_i(1) + ... + S_i(k_i) tokens. A slot whose draft is
    behind[i] tokens short of its context first catches up, p seconds a token, a cost
    spread over the HORIZON steps the plan looks ahead to (after plain steps under load,
    hundreds of tokens: measured at 8 clients, a switch to drafting cost 1.5-2.5 s). one:
    the measured seconds of a decode of one token, where known (VerifyCost.one): a plain
    step alone costs that, and no longer decode less.

    One length, not one a slot: with a cache stream a sequence (a server's slots), llama.cpp
    splits a batch whose sequences hold unequal numbers of tokens into several graph runs
    (split_equal), so unequal lengths cost far more than their tokens say. Measured with 8
    slots on the F32 SmolLM2 (2 threads): 8 x 1 tokens 58 ms, 8 x 2 84 ms, 8 x 3 116 ms, but
    one slot 9 and seven 1 (16 tokens) 125 ms, and every other slot 2 (12 tokens) 169 ms."""
    B, K = S.shape
    if K == 0:
        return np.zeros(B, dtype=int)
    cum = np.concatenate((np.zeros((B, 1)), np.cumsum(S, axis=1)), axis=1)  # E_i(k) - 1
    caps = (S > 0).sum(axis=1)
    ks = np.minimum(np.arange(K + 1)[:, None], caps[None, :])  # (k, slot): each slot's k
    tokens = B + cum[np.arange(B)[None, :], ks].sum(axis=1)
    n = B + ks.sum(axis=1)
    seconds = t1 * (1 + slope * (n - 1))
    if one is not None:
        seconds = np.where(n <= 1, one, np.maximum(seconds, one))
    seconds = seconds + np.arange(K + 1) * c
    if behind is not None and p > 0.0:
        seconds = seconds + p * ((ks > 0) * behind[None, :]).sum(axis=1) / HORIZON
    goodput = tokens / seconds
    return ks[int(np.argmax(goodput))]


class Adaptive(DraftSource):
    """Wraps one draft source; caps the k it is asked for at the current best length."""

    def __init__(self, source: DraftSource, cost: VerifyCost | None = None, seed: int = 0,
                 prior: float = 0.7, n_min: int = 1,
                 clock: Callable[[], float] = time.perf_counter, batch: Batch | None = None,
                 who: object = None):
        self.source = source
        # a server's slot: its k is chosen for the batch, whose decodes are timed where they
        # are made (a slot's own clock would count the others' tokens as its own); `run`'s
        # draft is a batch of one whose steps the engine times (timer), plain ones included
        self._timed_here = batch is None
        self.batch = batch if batch is not None else Batch(cost, seed)
        self.who = who if who is not None else self
        self.n_min = n_min  # --draft-min: a shorter draft is discarded, and nothing is learnt
        self.prior = prior  # per-token acceptance assumed before any is measured
        self._clock = clock
        self.name, self.own_length = source.name, source.own_length
        self.model = source.model
        # decayed counts per draft position j (index j): steps that drafted j with 1..j-1
        # accepted, and steps that also had j accepted
        self._tried = np.zeros(DRAFT_AUTO_MAX + 1)
        self._hit = np.zeros(DRAFT_AUTO_MAX + 1)
        # drafting seconds and drafted tokens, decayed per proposal: their ratio is the time
        # a token (a mean from 0 would say a draft is free until it has drafted for a while:
        # four proposals of 30 tokens read a fifth of the real cost)
        self._t_draft = self._n_draft = 0.0
        self._pending: int | None = None  # the tokens of the proposal being verified
        self._earned = 0.0  # the target's seconds alone since the draft last drafted
        self.k = 0  # the last length chosen
        self._rested = False  # the last step drafted nothing (0 chosen)
        self._first = True  # no step of this generation yet
        self._probes = 0  # plain steps taken to time one (PROBES at most: an engine times it)
        self._rest: tuple[int, float, float, int] | None = None  # a plan alone of k = 0, as of
        self._rest_one = 0.0  # (the cost of one token it was made with)

    @property
    def cost(self) -> VerifyCost:
        """The target's verification cost: its batch's."""
        return self.batch.cost

    @property
    def t_token(self) -> float:
        """Seconds a drafted token (0 until measured)."""
        return self._t_draft / self._n_draft if self._n_draft else 0.0

    @property
    def acceptance(self) -> float:
        """The pooled per-token acceptance rate (with its prior)."""
        a = ((self._hit[1:].sum() + PRIOR_STEPS * self.prior)
             / (self._tried[1:].sum() + PRIOR_STEPS))
        return min(max(float(a), 0.01), 0.99)

    def survival(self, k_max: int) -> np.ndarray:
        """S(j) for j = 1..k_max, the chance that the first j drafted tokens are accepted.
        Each position's acceptance rate is shrunk towards the rate of the position before
        it, so a position never tried inherits the deepest measured one: a run of full
        acceptances makes longer drafts worth trying."""
        rates = np.empty(k_max)
        prior = self.acceptance
        for j in range(1, k_max + 1):
            prior = (self._hit[j] + PRIOR_STEPS * prior) / (self._tried[j] + PRIOR_STEPS)
            rates[j - 1] = prior
        return np.cumprod(rates)

    def best_k(self, k_max: int, behind: int = 0) -> int:
        """The length with the most tokens per second in the batch's plan (a share of its
        steps one longer or shorter, Batch.choose), 0 where none beats the target alone
        (alone, EXPLORE_REST of such steps the shortest draft --draft-min allows)."""
        k_max = min(k_max, DRAFT_AUTO_MAX)
        if k_max < 1:
            self.batch.choose(self.who, np.zeros(0), self.t_token)  # in the plan: its token
            return 0
        one, alone = self.cost.one(), self.batch.members() == 1
        # what a plan alone depends on but one and the catch-up (which only grows in a rest:
        # drafting pays no more): the line, the draft's cost and its acceptance
        rest = (self.cost.version, self._n_draft, float(self._tried[1]), k_max)
        if alone and rest == self._rest and one is not None and one <= self._rest_one:
            k = 0  # the plan alone of the last step, whose k was 0: not made again (250-370
            # us a step on the F16 SmolLM2, whose plain step takes 10 ms: 3% of its speed)
        else:
            k = self.batch.choose(self.who, self.survival(k_max), self.t_token, behind,
                                  self._shared())
            self._rest = rest if alone and k == 0 else None
            self._rest_one = one if one is not None else 0.0
        if not self._n_draft:  # a draft of unknown cost, planned as if free: a short one
            # first (one as slow as its target costs little, and then its cost is known).
            # Planned at its full length, not the short one's: on the F16 SmolLM2 a
            # verification of 3 tokens costs 3x a plain step, so an n-gram source planned at
            # 2 tokens never drafted, and never learnt that its drafts are free and long
            k = min(k, max(COLD_K, self.n_min))
        n_one = self.cost.n_one()
        if (k > 0 and not self._first and alone
                and (n_one < PROBES and self._probes < PROBES
                     or one is not None and EXPLORE_REST * self.cost.since_one() >= one)):
            # alone, and a plain step never timed (or not for a while): one (every source
            # of a chain at the same step: their cost is one), so that the plan compares
            # drafting with what the target alone costs, not with the verifications' line
            # read at one token (a plain step is no loss: the target's token at a plain
            # step's price). Again now and then: one timed once, 1.8x too dear (the machine
            # busy for a moment), kept `run --draft auto` drafting where it lost, and a
            # draft that always drafts never times another
            self._probes += n_one < PROBES
            return 0
        if k == 0 and alone:  # no length beats the target alone:
            # explore once the plain steps since the last draft have earned it (EXPLORE_REST
            # of their time: a draft far behind costs more than its rest earned, and stays
            # off; drawn at random 4% of the steps, catch-ups of up to 91 tokens, 280 ms
            # each, cost `run --draft auto` a quarter of its speed on the F16 SmolLM2); a
            # draft that would not pay even if always right, only at a generation's first
            # step. Only alone: beside other slots one slot's exploring draft would cost
            # every one of them a decode of unequal lengths (a graph run more) and itself a
            # catch-up of what it missed (at 8 clients, one exploring slot a 25th of the
            # steps cost 8% of the throughput); there the plan decides on the estimates it
            # has, and a slot left alone explores again
            plain = self.cost.at(1)
            n = max(self.n_min, 1)
            # (a catch-up not yet timed is not priced: the exploration times it, and a
            # prior's guess could keep a draft that a cold first step misjudged off for good)
            catch_up = self.batch.catch_up
            price = ((behind * catch_up.rate(self.t_token) if catch_up.known() else 0.0)
                     + n * self.t_token + max(self.cost.at(1 + n) - plain, 0.0))
            if self._first or EXPLORE_REST * self._earned >= price:
                k = int(not self._first if self.batch.could(self.who) else self._first)
            self._earned += plain
        return 0 if k <= 0 else min(max(k, self.n_min, 1), k_max)

    def _shared(self) -> bool:
        """A server slot's draft model (its batch's draft context times it)."""
        return not self._timed_here and self.model is not None

    def names(self) -> tuple[str, ...]:
        return self.source.names()

    def begin(self, prompt: Sequence[int]) -> Reads | None:
        self._pending, self._first = None, True
        self.batch.join(self.who, self.t_token, self._shared())
        return self.source.begin(prompt)

    def propose(self, context: Sequence[int], k: int, sp: SamplingParams,
                rng: np.random.Generator, policy: DraftPolicy | None = None,
                rules: Rules | None = None) -> Tree:
        behind = self.source.behind(context) if k > 0 else 0
        self.k = self.best_k(k, behind)
        cold, self._first = self._first, False
        if self.k == 0:  # the target alone this step: the draft catches up when it drafts
            self._rested = True
            return Tree()
        self._earned = 0.0
        # what it missed (a rest, a lazy prompt) is decoded first: not its drafting
        t0 = self._clock()
        caught_up = self.source.catch_up(context)
        if behind:
            self.batch.catch_up.add(behind, self._clock() - t0)
        t0 = self._clock()
        p = self.source.propose(context, self.k, sp, rng, policy, rules)
        t1 = self._clock()
        if p.tokens:
            # not a generation's first (cold) proposal, nor one that caught up inside it
            # (a known cost is not overwritten by that)
            if not (cold and self.model is not None
                    or self._rested and self._n_draft and not caught_up):
                self._t_draft = DECAY * self._t_draft + (t1 - t0)
                self._n_draft = DECAY * self._n_draft + len(p.tokens)
            self._pending = len(p.tokens)
        self._rested = False
        return p

    def process(self, batch: Decoded) -> None:
        self.source.process(batch)

    def accept(self, outcome: Outcome) -> None:
        """A verified proposal: its cost and how far it was accepted."""
        n_accepted = outcome.n_accepted
        if outcome.tree is not None and self._pending is not None:
            drafted, self._pending = self._pending, None
            self._tried *= DECAY
            self._hit *= DECAY
            reached = min(n_accepted + 1, drafted, DRAFT_AUTO_MAX)  # the first rejected too
            self._tried[1:reached + 1] += 1
            self._hit[1:min(n_accepted, DRAFT_AUTO_MAX) + 1] += 1
        self.source.accept(outcome)

    def end(self) -> None:
        self.batch.drop(self.who)
        self.source.end()

    def timer(self) -> Callable[[int, float], None] | None:
        # not a generation's first step: after its prompt each model's first decode runs
        # cold (measured in `run` on the F32 SmolLM2: its verification and its draft 1.2-1.6x
        # their later cost, and read so, 1 run in 8 kept a draft that pays off for good)
        return self.cost.add if self._timed_here and not self._first else None
