"""The cost model behind `check-pair --probe` (and later tune-draft), on known figures."""

from __future__ import annotations

import pytest

from specli.stats import ModelPerf, Stats
from specli.tuning import Costs, best_draft, costs, estimated_speedup, expected_tokens


def test_expected_tokens_sums_the_survival_rates():
    s = [0.9, 0.6, 0.3]
    assert expected_tokens(s, 0) == 1.0
    assert expected_tokens(s, 2) == pytest.approx(2.5)
    assert expected_tokens(s, 5) == pytest.approx(2.8)  # unmeasured positions add nothing


def test_estimated_speedup_on_hand_figures():
    c = Costs(t_target=1.0, t_draft=0.1, slope=0.1, overhead_step=0.0, overhead_token=0.0)
    # E(3) = 4 tokens for 3 drafts (0.3) plus a batch of 4 (1 + 0.1 * 3)
    assert estimated_speedup([1, 1, 1], c, 3) == pytest.approx(4 / 1.6)
    assert estimated_speedup([0, 0, 0], c, 2) < 1  # nothing accepted: pure cost
    assert estimated_speedup([], Costs(0, 0, 0, 0, 0), 1) == 0.0  # nothing measured


def test_best_draft_stops_where_acceptance_stops_paying():
    c = Costs(t_target=1.0, t_draft=0.2, slope=0.1, overhead_step=0.0, overhead_token=0.0)
    k, est = best_draft([0.9, 0.8, 0.1, 0.05], c, 4)
    assert k == 2 and est == pytest.approx(2.7 / 1.6)


def test_costs_from_speculative_and_plain_runs():
    base = Stats(n_predict=10, t_decode_s=1.0, t_target_decode_s=1.0,
                 target=ModelPerf(eval_runs=10, eval_n=10))
    spec = Stats(n_predict=10, n_steps=2, n_drafted=8, t_decode_s=0.6,
                 t_draft_decode_s=0.2, t_target_decode_s=0.4,
                 target=ModelPerf(eval_runs=2, eval_n=10))
    c = costs([spec], [base])
    assert c.t_target == pytest.approx(0.1)
    assert c.t_draft == pytest.approx(0.025)
    # batches of 5 cost 0.2 s against 0.1 s for one token: each extra token adds 25%
    assert c.slope == pytest.approx(0.25)
    assert c.overhead_step == pytest.approx(0.0) and c.overhead_token == pytest.approx(0.0)
