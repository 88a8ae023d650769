"""Sampling declared once (issue 32, point 4): config.SAMPLING is the one declaration; the
CLI's flags, the server's request schema and generation_settings derive from it, and every
entry point refuses the same values, with SamplingParams' one check, each in its own words."""

from __future__ import annotations

import json
import math

import pytest
from conftest import specli
from fakeserver import serve
from test_cli import one_line_error
from typer.testing import CliRunner

from specli.cli.app import app
from specli.cli.options import SAMPLING_FLAGS
from specli.config import SAMPLING, Knob, SamplingError, SamplingParams
from specli.errors import UsageError
from specli.server.schemas import ChatRequest, LlamaCompletionRequest


def bad_value(k: Knob):
    """A value just outside the knob's range (a non-finite one where it has none)."""
    if k.high is not None:
        return k.kind(k.high + 1)
    if k.low is not None:
        return k.kind(k.low) if k.above else k.kind(k.low - 1) if k.unset is None else None
    return math.inf if k.kind is float else None


def edge_value(k: Knob):
    """The knob's lowest value (or one just above it)."""
    if k.low is None:
        return k.kind(-3)
    return k.kind(k.low + 0.25) if k.above else k.kind(k.low)


BAD = [(k, bad_value(k)) for k in SAMPLING if bad_value(k) is not None]


def test_every_knob_is_a_field_a_flag_and_a_request_parameter():
    fields = set(SamplingParams.__dataclass_fields__)
    flags = {q.name for q in SAMPLING_FLAGS.params()}
    for k in SAMPLING:
        assert k.field in fields and k.field in flags, k
        assert k.name in ChatRequest.model_fields and k.name in LlamaCompletionRequest.model_fields
    assert len(BAD) >= 10  # every knob with a range is tried below


@pytest.mark.parametrize("knob,value", BAD, ids=[k.field for k, _ in BAD])
def test_samplingparams_refuses_a_value_out_of_range_naming_the_field(knob, value):
    with pytest.raises(SamplingError) as e:
        SamplingParams(**{knob.field: value})
    assert e.value.knob is knob and e.value.message.startswith(f"{knob.field} must be ")
    SamplingParams(**{knob.field: edge_value(knob)})  # the edge itself is fine


@pytest.mark.parametrize("bad", [{"temp": "0.8"}, {"top_k": 2.5}, {"seed": True},
                                 {"temp": math.nan}, {"logit_bias": ((5, math.nan),)},
                                 {"logit_bias": ((-1, 1.0),)}, {"n_probs": 101},
                                 {"dry_sequence_breakers": ("x",) * 65}])
def test_samplingparams_refuses_wrong_types_and_the_other_fields(bad):
    with pytest.raises(SamplingError, match=f"^{next(iter(bad))} must be"):
        SamplingParams(**bad)


def test_a_face_reads_unset_values_as_llama_cpp_does():
    seed = next(k for k in SAMPLING if k.field == "seed")
    base = next(k for k in SAMPLING if k.field == "dry_base")
    server = SamplingParams(seed=7, dry_base=3.0)
    assert seed.read(-1) is None and seed.read(-1, server) is None  # random, whatever the base
    assert base.read(0.5) == SamplingParams.dry_base and base.read(0.5, server) == 3.0
    assert base.read(2.0, server) == 2.0 and seed.read(9, server) == 9


@pytest.mark.parametrize("knob,value", BAD, ids=[k.field for k, _ in BAD])
def test_the_cli_refuses_the_same_values_naming_the_flag(knob, value):
    flag = next(f for f in knob.flags if f.startswith("--"))
    r = CliRunner().invoke(app, ["run", "-p", "hi", flag, str(value)])
    assert r.exit_code != 0 and isinstance(r.exception, UsageError), r.output
    assert str(r.exception).startswith(f"{flag} must be "), r.exception


def test_the_cli_says_it_in_one_line_with_exit_2():
    one_line_error(specli("run", "-p", "hi", "--top-p", "1.5"), 2, "--top-p must be from 0 to 1")


@pytest.fixture(scope="module")
def fake():
    with serve() as client:
        yield client


@pytest.mark.parametrize("knob,value", BAD, ids=[k.field for k, _ in BAD])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/completion"])
def test_the_server_refuses_the_same_values_naming_the_parameter(fake, route, knob, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} \
        if "chat" in route else {"prompt": "hi", "n_predict": 2}
    # Python's JSON (Starlette's parser) reads Infinity: a body may carry one
    r = fake.post(route, content=json.dumps({**body, knob.name: value}),
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == knob.name and err["message"].startswith(f"{knob.name} must be ")
    r = fake.post(route, json={**body, knob.name: edge_value(knob)})
    assert r.status_code == 200, r.text


def test_the_limits_are_the_same_on_every_face(fake):
    """The server took OpenAI's temperature cap of 2 where the CLI took any; llama-server has
    none: neither has now."""
    r = fake.post("/completion", json={"prompt": "hi", "n_predict": 2, "temperature": 3.5,
                                       "seed": 1})
    assert r.status_code == 200 and r.json()["generation_settings"]["temperature"] == 3.5
    assert SamplingParams(temp=3.5).temp == 3.5


def test_generation_settings_report_every_knob_by_its_request_name(fake):
    params = fake.get("/props").json()["default_generation_settings"]["params"]
    sp = SamplingParams(temp=0.0)
    for k in SAMPLING:
        want = -1 if k.field == "seed" else getattr(sp, k.field)
        assert params[k.name] == want, k


def test_llama_cpp_values_stay_accepted_and_non_finite_ones_refused(fake):
    """top_k -1 disables top-k in llama.cpp: accepted everywhere; a dry_base of -inf is not a
    value below 1 (llama.cpp's "keep the default") but no number: refused everywhere."""
    assert SamplingParams(top_k=-1).top_k == -1
    assert fake.post("/completion", json={"prompt": "hi", "n_predict": 2,
                                          "top_k": -1}).status_code == 200
    r = CliRunner().invoke(app, ["run", "-p", "hi", "--dry-base", "-inf"])
    assert str(r.exception) == "--dry-base must be a finite number, got -inf"
    r = fake.post("/completion", content='{"prompt": "hi", "dry_base": -Infinity}',
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dry_base", r.text


@pytest.mark.parametrize("bias", ['{"3": NaN}', '[[3, false], [3, 1e999]]'])
def test_a_bias_that_is_no_number_is_a_400_naming_it(fake, bias):
    r = fake.post("/completion", content=f'{{"prompt": "hi", "logit_bias": {bias}}}',
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and err["code"] == "invalid_value", err


def test_the_request_schema_publishes_each_range(fake):
    props = fake.get("/openapi.json").json()["components"]["schemas"]["ChatRequest"][
        "properties"]
    assert props["temperature"]["minimum"] == 0 and "maximum" not in props["temperature"]
    assert props["top_p"]["maximum"] == 1 and props["top_p"]["minimum"] == 0
    assert props["repeat_penalty"]["exclusiveMinimum"] == 0
    assert "minimum" not in props["seed"]  # -1: a random one


@pytest.mark.parametrize("route,body", [
    ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"max_output_tokens": 2, "input": "hi"}),
])
def test_messages_and_responses_take_every_knob_as_the_chat_route_does(fake, route, body):
    """Anthropic's Messages and OpenAI's Responses carry config.SAMPLING's parameters by
    their request names (llama-server's min_p, seed... beside their own temperature, top_p
    and top_k): the same values pass, the same are refused, naming the parameter."""
    assert fake.post(route, json={**body, "top_k": 5, "min_p": 0.1, "seed": 3}
                     ).status_code == 200
    for knob, value in BAD:
        r = fake.post(route, content=json.dumps({**body, knob.name: value}),
                      headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (knob.name, r.text)
        assert knob.name in r.text, (knob.name, r.text)
