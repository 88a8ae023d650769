"""Drafting declared once and planned once (issue 58, point 1): config.DRAFTING is the one
declaration of the draft lengths and trees; the CLI's flags and the server's `speculative`
object derive from it, DraftPolicy and SpecRequest check themselves against it, every face
accepts the same ranges and names the setting in its own words; a command resolves its plan
once and checks its files once, a request its own settings once."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import specli
from fakeserver import serve
from fastapi.testclient import TestClient
from test_cli import one_line_error
from typer.testing import CliRunner

from specli import plan as plan_mod
from specli.cli.app import app
from specli.cli.options import DRAFTING_FLAGS
from specli.config import DRAFTING, DraftKnob, DraftPolicy, PlanError, SpecRequest
from specli.errors import UsageError
from specli.plan import SpecPlan
from specli.server.schemas import LlamaCompletionRequest, Speculative


def bad_values(k: DraftKnob) -> list:
    """Values just outside the knob's range, below and (where it has one) above."""
    step = 1 if k.kind is int else 0.5
    out = [k.kind(k.low - step)]
    if k.high is not None:
        out.append(k.kind(k.high + step))
    return out


BAD = [(k, v) for k in DRAFTING for v in bad_values(k)]
IDS = [f"{k.field}={v}" for k, v in BAD]


def test_every_knob_is_a_field_a_flag_and_a_request_parameter():
    flags = {q.name for q in DRAFTING_FLAGS.params()}
    flat = {f.alias for f in LlamaCompletionRequest.model_fields.values()}
    for k in DRAFTING:
        assert k.field in DraftPolicy.__dataclass_fields__, k
        assert k.field in SpecRequest.__dataclass_fields__, k
        assert k.field in flags and k.name in Speculative.model_fields, k
        assert f"speculative.{k.name}" in flat, k
    assert {k.field for k in DRAFTING} == {"n_max", "n_min", "p_min", "n_seq", "p_split"}


@pytest.mark.parametrize("knob,value", BAD, ids=IDS)
def test_the_policy_and_a_request_refuse_a_value_out_of_range_naming_the_field(knob, value):
    for make in (DraftPolicy, SpecRequest):
        with pytest.raises(PlanError) as e:
            make(**{knob.field: value})
        assert e.value.field == knob.field
        assert e.value.message.startswith(f"{knob.field} must be "), e.value.message
        make(**{knob.field: knob.kind(knob.low)})  # the edge itself is fine
        if knob.high is not None:
            make(**{knob.field: knob.kind(knob.high)})


@pytest.mark.parametrize("knob,value", BAD, ids=IDS)
def test_the_cli_refuses_the_same_values_naming_the_flag(knob, value):
    r = CliRunner().invoke(app, ["run", "-p", "hi", knob.flags[0], str(value)])
    assert r.exit_code != 0 and isinstance(r.exception, UsageError), r.output
    assert str(r.exception).startswith(f"{knob.flags[0]} must be "), r.exception


@pytest.fixture(scope="module")
def fake():
    with serve() as client:
        yield client


@pytest.mark.parametrize("knob,value", BAD, ids=IDS)
@pytest.mark.parametrize("spelling", ["object", "flat"])
def test_the_server_refuses_the_same_values_naming_the_parameter(fake, knob, value, spelling):
    name = f"speculative.{knob.name}"

    def body(v) -> dict:
        spec = {"speculative": {knob.name: v}} if spelling == "object" else {name: v}
        return {"prompt": "hi", "n_predict": 2, **spec}

    r = fake.post("/completion", json=body(value))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == name and err["message"].startswith(f"{name} must be "), err
    r = fake.post("/completion", json=body(knob.kind(knob.low)))
    assert r.status_code == 200, r.text


def test_a_minimum_above_the_maximum_is_refused_on_both_faces_in_their_words(fake):
    r = CliRunner().invoke(app, ["run", "-p", "hi", "--draft", "2", "--draft-min", "3"])
    assert str(r.exception) == "--draft-min must be between 0 and --draft (2), got 3"
    r = fake.post("/completion", json={"prompt": "hi", "n_predict": 2,
                                       "speculative": {"n_max": 2, "n_min": 3}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative.n_min"
    assert r.json()["error"]["message"] == ("speculative.n_min must be between 0 and "
                                            "speculative.n_max (2), got 3")


def test_a_draft_length_has_no_upper_bound_on_either_face(fake):
    """llama.cpp bounds neither; the server's old cap of 64 is gone: a request's n_max only
    caps the server's own."""
    assert DraftPolicy(n_max=100000).n_max == 100000
    r = fake.post("/completion", json={"prompt": "hi", "n_predict": 2,
                                       "speculative": {"n_max": 100000}})
    assert r.status_code == 200, r.text


def test_the_server_takes_n_seq_and_p_split_and_refuses_a_tree_it_was_not_loaded_for(fake):
    r = fake.post("/completion", json={"prompt": "hi", "n_predict": 2,
                                       "speculative": {"n_seq": 1, "p_split": 0.3}})
    assert r.status_code == 200, r.text
    r = fake.post("/completion", json={"prompt": "hi", "n_predict": 2,
                                       "speculative.n_seq": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "speculative.n_seq"
    assert err["message"] == ("speculative.n_seq 2 is more than the 1 draft sequences the "
                              "models were loaded for: start the server with --draft-n-seq N")


def test_a_plan_error_says_each_setting_in_the_faces_words():
    e = PlanError("a draft tree ({n_seq} above 1) takes a fixed {n_max}, not auto", "n_max")
    assert e.message == "a draft tree (n_seq above 1) takes a fixed n_max, not auto"
    assert e.said({"n_seq": "-np", "n_max": "--draft"}) == \
        "a draft tree (-np above 1) takes a fixed --draft, not auto"
    with pytest.raises(PlanError) as got:  # a user's text is never read as a setting
        SpecRequest(types=("{n_max}",))
    assert got.value.said({"n_max": "--draft"}).startswith("unknown speculation type {n_max}")


class Count:
    """How often the plan is resolved, a request's settings checked against it, and the
    files checked."""

    def __init__(self, monkeypatch):
        self.n = Counter()
        resolve, request = SpecPlan.resolve.__func__, SpecPlan.request
        check = plan_mod.check_files

        def counted(name, fn):
            def wrapper(*a, **kw):
                self.n[name] += 1
                return fn(*a, **kw)
            return wrapper

        monkeypatch.setattr(SpecPlan, "resolve", classmethod(counted("resolve", resolve)))
        monkeypatch.setattr(SpecPlan, "request", counted("request", request))
        monkeypatch.setattr(plan_mod, "check_files", counted("check_files", check))


def test_run_resolves_its_plan_once_and_checks_its_files_once(monkeypatch, f16, q4_1):
    count = Count(monkeypatch)
    r = CliRunner().invoke(app, ["run", "-m", f16, "-md", q4_1, "-p", "hi", "-n", "2",
                                 "--temp", "0", "--spec-type", "ngram-simple", "--json"])
    assert r.exit_code == 0, r.output
    assert count.n == {"resolve": 1, "check_files": 1}


def test_serve_resolves_its_plan_once_and_a_request_its_settings_once(monkeypatch, f16, q4_1):
    from specli.cli import serve as serve_cmd
    from specli.server.app import State, create_app

    count, configs = Count(monkeypatch), []
    monkeypatch.setattr(serve_cmd, "_run", lambda cfg, hosts, port: configs.append(cfg))
    r = CliRunner().invoke(app, ["serve", "-m", f16, "-md", q4_1, "-c", "256", "--temp", "0",
                                 "--spec-type", "ngram-simple", "--draft", "4"])
    assert r.exit_code == 0, r.output
    st = State(configs[0])
    st.load()
    with TestClient(create_app(st.config, state=st)) as client:
        assert count.n == {"resolve": 1, "check_files": 1}  # before listening, not again
        for spec in ({"type": "draft-simple", "n_max": 2}, {"n_seq": 1}, None):
            count.n.clear()
            r = client.post("/completion", json={"prompt": "hi", "n_predict": 3,
                                                 "speculative": spec})
            assert r.status_code == 200, r.text
            assert count.n == ({"request": 1} if spec else {}), spec
        assert r.json()["generation_settings"]["speculative.types"] == \
            "ngram-simple,draft-simple"


def test_the_cli_says_a_plan_error_in_one_line_with_exit_2_naming_the_flag_given(f16, q4_1):
    one_line_error(specli("run", "-m", f16, "-md", q4_1, "-p", "hi", "-np", "2", "--draft",
                          "auto"), 2,
                   "a draft tree (-np/--parallel above 1) takes a fixed --draft, not auto")
