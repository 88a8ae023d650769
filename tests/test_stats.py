"""The statistics block is a golden file; the JSON field names are a contract (docs/stats.md)."""

from __future__ import annotations

import json
from pathlib import Path

from specli.stats import ModelPerf, Stats, format_llama

DATA = Path(__file__).parent / "data"


def fixed_stats() -> Stats:
    s = Stats(n_draft=8, n_prompt=36, t_encode_s=0.25, n_predict=128, t_decode_s=2.0,
              t_draft_decode_s=1.2, t_target_decode_s=0.7, seed=42, finish_reason="length",
              draft=ModelPerf(load_ms=100.0, prompt_ms=50.0, prompt_n=35, eval_ms=1200.0,
                              eval_runs=96, eval_n=110),
              target=ModelPerf(load_ms=200.0, prompt_ms=150.0, prompt_n=35, eval_ms=700.0,
                               eval_runs=16, eval_n=136),
              baseline_decode_tps=40.0, n_plain=2)
    for n_acc in (8, 8, 3, 8, 0, 8, 8, 8, 8, 5, 8, 8, 8, 8, 8, 8):
        s.record_step(8, n_acc)
    return s


def test_stats_block_is_exactly_the_golden_file():
    assert format_llama(fixed_stats()) == (DATA / "stats_golden.txt").read_text()


def test_llama_cpp_lines_come_first_in_llama_cpp_format():
    lines = format_llama(fixed_stats()).splitlines()
    assert lines[0] == "encoded   36 tokens in    0.250 seconds, speed:  144.000 t/s"
    assert lines[1] == "decoded  128 tokens in    2.000 seconds, speed:   64.000 t/s"
    assert lines[3:8] == ["n_draft   = 8", "n_predict = 128", "n_drafted = 128",
                          "n_accept  = 112", "accept    = 87.500%"]


def test_derived_figures():
    s = fixed_stats()
    assert s.mean_accept_len == 1 + 112 / 16
    assert s.accept_rate_per_pos[0] == 15 / 16
    assert s.speedup == 64.0 / 40.0
    assert abs(s.overhead_s - 0.1) < 1e-12


def test_json_field_names_are_stable():
    d = fixed_stats().to_dict()
    assert sorted(d) == json.loads((DATA / "stats_fields.json").read_text())
    json.dumps(d)  # serialisable as it is
