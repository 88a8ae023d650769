"""The cost model behind `check-pair --probe` (and later tune-draft), on known figures."""

from __future__ import annotations

import pytest

from specli.stats import ModelPerf, Stats
from specli.tuning import CostModel, best_draft, costs, expected_tokens


def test_expected_tokens_sums_the_survival_rates():
    s = [0.9, 0.6, 0.3]
    assert expected_tokens(s, 0) == 1.0
    assert expected_tokens(s, 2) == pytest.approx(2.5)
    assert expected_tokens(s, 5) == pytest.approx(2.8)  # unmeasured positions add nothing


def test_predicted_speedup_on_hand_figures():
    c = CostModel(c=0.1, v=(1.0, 1.1, 1.2, 1.3))
    # E(3) = 4 tokens for 3 drafts (0.3) plus a batch of 4 (1.3)
    assert c.speedup([1, 1, 1], 3) == pytest.approx(4 / 1.6)
    assert c.speedup([0, 0, 0], 2) < 1  # nothing accepted: pure cost
    assert CostModel(0.0, (0.0, 0.0)).speedup([], 1) == 0.0  # nothing measured
    with_overhead = CostModel(0.1, (1.0, 1.1), overhead_step=0.2, overhead_token=0.1)
    assert with_overhead.speedup([1.0], 1) == pytest.approx(2 * 1.1 / (0.1 + 1.1 + 0.2))


def test_best_draft_stops_where_acceptance_stops_paying():
    c = CostModel(c=0.2, v=(1.0, 1.1, 1.2, 1.3, 1.4))
    k, est = best_draft([0.9, 0.8, 0.1, 0.05], c, 4)
    assert k == 2 and est == pytest.approx(2.7 / 1.6)


def test_costs_from_speculative_and_plain_runs():
    base = Stats(n_predict=10, t_decode_s=1.0, t_target_decode_s=1.0,
                 target=ModelPerf(eval_runs=10, eval_n=10))
    spec = Stats(n_predict=10, n_steps=2, n_drafted=8, t_decode_s=0.6,
                 t_draft_decode_s=0.2, t_target_decode_s=0.4,
                 target=ModelPerf(eval_runs=2, eval_n=10))
    c = costs([spec], [base], k_max=4)
    assert c.c == pytest.approx(0.025)
    # one token costs 0.1 s alone; batches of 5 cost 0.2 s: each extra token adds 0.025 s
    assert c.v == pytest.approx((0.1, 0.125, 0.15, 0.175, 0.2))
    assert c.overhead_step == pytest.approx(0.0) and c.overhead_token == pytest.approx(0.0)
