"""`specli tune-draft` (issue 7): a tiny sweep on the real SmolLM2 pair, the cost model on
textbook inputs, and the ways its input can be wrong."""

from __future__ import annotations

import csv
import io
import json

import pytest
from conftest import cli

from specli.errors import UsageError
from specli.tuning import CostModel, Point, Setting, Sweep, grid


def test_a_tiny_sweep_reports_every_point_against_a_baseline(f16, q4_1, tmp_path):
    png = tmp_path / "sweep.png"
    r = cli("tune-draft", "-m", f16, "-md", q4_1, "--draft", "2,3", "--draft-p-min", "0,0.5",
               "--repeat", "1", "-n", "8", "--task", "chat", "--json",
               "--plot", str(png), timeout=600)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    base = doc["baseline"]
    assert base["baseline"] and base["tps_median"] > 0
    labels = [p["label"] for p in doc["points"]]
    assert labels == ["draft-simple k=2", "draft-simple k=3", "draft-simple k=2 p-min 0.5",
                      "draft-simple k=3 p-min 0.5"]
    for p in doc["points"]:
        assert p["speedup"] == pytest.approx(p["tps_median"] / base["tps_median"])
        assert p["tps_min"] <= p["tps_median"] <= p["tps_max"]
        assert 0 <= p["accept_rate"] <= 1 and p["mean_accept_len"] >= 1
        assert p["predicted_speedup"] is not None
    best = max(doc["points"], key=lambda p: p["tps_median"])  # the best is one of the points
    assert doc["best"]["label"] == best["label"] and doc["best"]["speedup"] > 0
    assert doc["predicted_best_draft"] in (2, 3)
    assert len(doc["costs"]["verify_s_by_batch"]) == 4  # batches of 1..k_max+1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_csv_and_the_text_report(f16, q4_1):
    r = cli("tune-draft", "-m", f16, "-md", q4_1, "--draft", "2", "--repeat", "1", "-n", "6",
               "--task", "structured", "--csv", timeout=600)
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert [row["label"] for row in rows] == ["target alone", "draft-simple k=2"]
    assert float(rows[1]["speedup"]) > 0
    assert "tune-draft: [" not in r.stderr  # --csv and --json print only what they print
    text = cli("tune-draft", "-m", f16, "-md", q4_1, "--draft", "2", "--repeat", "1", "-n",
                  "6", "--task", "structured", timeout=600)
    assert text.returncode == 0, text.stderr
    assert "target alone" in text.stdout and "draft-simple k=2" in text.stdout
    # stderr is no terminal here (a CI log): one line per finished run shows the progress
    lines = [ln for ln in text.stderr.splitlines() if ln.startswith("tune-draft: [")]
    assert len(lines) == 2 and lines[-1].startswith("tune-draft: [2/2] ")
    assert any("t/s, accept " in ln for ln in lines)


def test_plot_without_matplotlib_fails_before_any_model_loads(f16, q4_1, tmp_path, monkeypatch):
    import importlib.util

    from typer.testing import CliRunner

    from specli import plan
    from specli.cli.app import app

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))

    def load(*_a, **_k):
        raise AssertionError("the models were loaded before --plot was checked")

    monkeypatch.setattr(plan, "load", load)
    r = CliRunner().invoke(app, ["tune-draft", "-m", f16, "-md", q4_1,
                                 "--plot", str(tmp_path / "p.png")])
    assert isinstance(r.exception, UsageError), r.output  # exit 2 through specli's main
    assert "--plot needs matplotlib" in r.exception.message


def test_the_cost_model_gives_the_textbook_values():
    # iid acceptance a: S(j) = a^j, E(k) = (1 - a^(k+1)) / (1 - a) (Leviathan et al. 2023)
    a, c, v = 0.8, 0.1, (1.0, 1.1, 1.2, 1.3)
    model = CostModel(c, v)
    s = [a ** j for j in range(1, 4)]
    expected = (1 - a ** 4) / (1 - a)
    assert model.speedup(s, 3) == pytest.approx(expected * 1.0 / (3 * c + 1.3))
    assert model.speedup(s, 1) == pytest.approx((1 + a) / (c + 1.1))
    assert model.speedup([], 0) == 1.0
    free = CostModel(0.0, (1.0, 1.0, 1.0, 1.0))  # free drafts, flat verification
    assert free.speedup([1.0, 1.0, 1.0], 3) == pytest.approx(4.0)


def test_no_setting_beating_the_baseline_is_said_plainly(capsys):
    from specli.cli.tune import _print

    base = Point(None, tps=[100.0])
    slow = Point(Setting(4, 0.0, ("draft-simple",)), tps=[80.0], n_drafted=8, n_accept=2,
                 n_steps=2, speedup=0.8)
    _print(Sweep(base, [slow]), "t.gguf", "d.gguf")
    text = capsys.readouterr().out
    assert "no setting beats the target alone" in text and "--no-spec" in text
    assert "specli run" not in text


def test_the_grid_has_a_guard():
    from specli.errors import UsageError

    with pytest.raises(UsageError, match="at most 64"):
        grid(range(1, 17), [0.0, 0.1, 0.2, 0.3, 0.4], [("draft-simple",)])


@pytest.mark.parametrize("args,needle", [
    (["--draft", "4,x"], "whole numbers"),
    (["--draft", "0,4"], "between 1 and 64"),
    (["--draft-p-min", "2"], "between 0 and 1"),
    (["--task", "poetry"], "unknown --task"),
    (["--spec-type", "magic"], "unknown --spec-type"),
])
def test_bad_sweep_input_is_exit_2(q4_1, args, needle):
    r = cli("tune-draft", "-m", q4_1, "-md", q4_1, *args)
    assert r.returncode == 2 and needle in r.stderr, r.stderr


def test_prompt_files_lines_and_jsonl(q4_1, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    r = cli("tune-draft", "-m", q4_1, "-md", q4_1, "-f", str(empty))
    assert r.returncode == 2 and "prompt file is empty" in r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    r = cli("tune-draft", "-m", q4_1, "-md", q4_1, "-f", str(bad))
    assert r.returncode == 2 and 'needs a "prompt" string' in r.stderr
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "Say hi."}\nWrite one word.\n')
    r = cli("tune-draft", "-m", q4_1, "-md", q4_1, "-f", str(good), "--draft", "2",
               "--repeat", "1", "-n", "4", "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["points"][0]["label"] == "draft-simple k=2"


def test_a_busy_machine_makes_the_sweep_say_it_is_unreliable(capsys):
    """tune-draft judges its own measurement: a baseline that swung 3x between its runs, or a
    measured speedup far from the cost model's, is flagged (text and --json); steady figures
    are not."""
    from specli.cli.tune import _print

    k8 = Setting(8, 0.0, ("draft-simple",))
    busy = Sweep(Point(None, tps=[10.0, 30.0]),
                 [Point(k8, tps=[60.0, 62.0], n_drafted=80, n_accept=40, n_steps=10,
                        speedup=3.05, predicted=2.9)])
    assert "varied 3.0x" in busy.unreliable and busy.to_dict()["unreliable"]
    _print(busy, "t.gguf", "d.gguf")
    text = capsys.readouterr().out
    assert "unreliable: the machine was busy" in text and "--repeat 3" in text
    assert "specli run" not in text  # no command to paste from figures that cannot be trusted

    # one run each: no range to show, and a 4.98x measured against 0.80x predicted
    far = Sweep(Point(None, tps=[20.0]), [Point(k8, tps=[99.6], n_steps=10, speedup=4.98,
                                                predicted=0.80)])
    assert "predicts 0.80x" in far.unreliable
    _print(far, "t.gguf", "d.gguf")
    text = capsys.readouterr().out
    assert "--repeat 1" in text and "no range" in text and "1.5-1.5" not in text

    steady = Sweep(Point(None, tps=[20.0, 21.0]), [Point(k8, tps=[30.0, 31.0], n_steps=10,
                                                         speedup=1.5, predicted=1.4)])
    assert steady.unreliable is None and steady.to_dict()["unreliable"] is None


def test_the_probe_judges_itself_too():
    from specli.tuning import ProbeResult

    r = ProbeResult(n_draft=8, rows=(), accept_rate=0.5, accept_rate_per_pos=(0.5,),
                    speedup=4.98, suggested_draft=4, estimated_speedup=0.8, worth_it=True,
                    unreliable="measured 4.98x but the cost model predicts 0.80x")
    assert r.recommendation.startswith("unreliable: ") and r.to_dict()["unreliable"]


def test_the_grid_sweeps_draft_trees():
    points = grid([4, 8], [0.0], [("draft-simple",)], n_seqs=[1, 3], p_splits=[0.05, 0.2])
    assert [p.label for p in points] == [
        "draft-simple k=4", "draft-simple k=8",
        "draft-simple k=4 n-seq 3 p-split 0.05", "draft-simple k=8 n-seq 3 p-split 0.05",
        "draft-simple k=4 n-seq 3 p-split 0.2", "draft-simple k=8 n-seq 3 p-split 0.2"]


def test_a_best_tree_setting_prints_its_flags(capsys):
    from specli.cli.tune import _print

    base = Point(None, tps=[100.0, 101.0])
    tree = Point(Setting(8, 0.0, ("draft-simple",), 4, 0.05), tps=[130.0, 131.0], n_drafted=8,
                 n_accept=6, n_steps=2, speedup=1.3)
    _print(Sweep(base, [tree]), "t.gguf", "d.gguf")
    text = capsys.readouterr().out
    assert "specli run -m t.gguf -md d.gguf --draft 8 --draft-n-seq 4 --draft-p-split 0.05" \
        in text
    # into a pipe the table is as wide as its cells: no label or figure cut to "…"
    assert "…" not in text
    assert any(line.startswith("draft-simple k=8 n-seq 4 p-split 0.05 ") and "1.30x" in line
               for line in text.splitlines())


def test_a_tiny_tree_sweep_on_the_real_pair(f16, q4_1):
    """On a weak draft (a third accepted), where trees branch."""
    from specli import defaults

    q2 = defaults.derived("q2_k", q4_1)
    r = cli("tune-draft", "-m", f16, "-md", q2, "--draft", "3", "--draft-n-seq", "1,2",
               "--draft-p-split", "0.05", "--repeat", "1", "-n", "6", "--task", "chat",
               "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    points = {p["label"]: p for p in json.loads(r.stdout)["points"]}
    assert list(points) == ["draft-simple k=3", "draft-simple k=3 n-seq 2 p-split 0.05"]
    tree = points["draft-simple k=3 n-seq 2 p-split 0.05"]
    assert tree["draft_n_seq"] == 2 and tree["draft_p_split"] == 0.05
    assert tree["tps_median"] > 0 and tree["predicted_speedup"] is None  # priced for chains
    assert tree["branches_per_step"] > 1.0  # it drafted trees, not one sequence
    assert points["draft-simple k=3"]["branches_per_step"] == 1.0
    bad = cli("tune-draft", "-m", f16, "-md", q4_1, "--draft-n-seq", "2",
                 "--spec-type", "ngram-simple")
    assert bad.returncode == 2 and "draft with the model alone" in bad.stderr


def test_the_best_command_carries_every_flag_that_shaped_the_measurement(capsys):
    """Swept with -t 1 on a busy machine, the suggested command without it ran 50x slower:
    the threads, batch sizes, cache types and flash attention given go with it."""
    from specli.cli import options as o
    from specli.cli.tune import _print

    t = 1  # the issue's: -t 1 on a busy machine (the default is auto)
    res = o.Resources(threads=t, threads_batch=2, ctk="q8_0", flash_attn=o.FlashAttn.on,
                      ubatch=128, ngl=99)
    args = o.speed_args(res, o.GPU_FLAGS.parse())
    assert args == ["-ngl", "99", "-t", str(t), "-tb", "2", "-ctk", "q8_0", "-fa", "on",
                    "-ub", "128"]
    assert o.speed_args(o.Resources(), o.GPU_FLAGS.parse()) == []  # the defaults: nothing
    best = Point(Setting(8, 0.0, ("draft-simple",), 1, 0.1), tps=[130.0, 131.0], n_drafted=8,
                 n_accept=6, n_steps=2, speedup=1.3)
    _print(Sweep(Point(None, tps=[100.0, 101.0]), [best]), "t.gguf", "d.gguf", args)
    text = capsys.readouterr().out
    for command in ("run", "serve"):
        assert (f"specli {command} -m t.gguf -md d.gguf --draft 8 -ngl 99 -t {t} -tb 2 -ctk "
                "q8_0 -fa on -ub 128") in text
