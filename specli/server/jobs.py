"""A request's settings as a slot's Job, checked before it takes a slot: the prompt against
the context, the sampling values (SamplingParams' own checks), the grammar or schema (in a
checker process), the logit bias, the request's own speculative settings against the
server's plan (once). Each refusal is a 400 naming the request's parameter. Every
generation route (server/routes.py, server/compat.py) makes its job here."""

from __future__ import annotations

import re
from dataclasses import replace

from specli import child
from specli.config import (
    DRAFTING,
    SAMPLING,
    SPEC_TYPES,
    PlanError,
    SamplingError,
    SpecRequest,
    parse_spec_types,
)
from specli.engine import check_bias
from specli.errors import UsageError
from specli.server import formats as f
from specli.server.errors import APIError, clip, overflow, refuse, unavailable
from specli.server.schemas import ABSENT, Sampling, Speculative
from specli.server.slots import Job
from specli.server.state import State


def first(*values):
    """The first value given (not None)."""
    return next((v for v in values if v is not None), None)


def job(st: State, body: Sampling, ids: list[int], n_predict: int | None,
         n_param: str, n_probs: int | None = None, post: bool = False,
         tools: tuple[dict, str] | None = None) -> Job:
    c = st.config
    n_ctx = st.engine.target.n_ctx
    if n_predict is not None and n_predict < 1 and not (n_param == "n_predict"
                                                        and n_predict == -1):
        raise APIError(400, f"{n_param} must be at least 1, got {n_predict}", param=n_param)
    if n_predict is not None and n_predict > n_ctx:
        raise APIError(400, f"{n_param} is {n_predict}, more than the context holds "
                       f"({n_ctx} tokens per slot)", param=n_param)
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    if len(ids) >= n_ctx:
        raise overflow(f"the prompt is {len(ids)} tokens, the context holds {n_ctx} per slot",
                       len(ids), n_ctx, "messages" if n_param == "max_tokens" else "prompt")
    for name, (_, _, neutral) in ABSENT.items():  # what clients send by default is no request
        value = getattr(body, name, None)
        if neutral is not None and value is not None and value not in neutral:
            raise refuse(name, "is not supported by specli (its neutral value "
                         f"{neutral[0]} is accepted)")
    s = c.sampling
    given = {k.field: k.read(v, s) for k in SAMPLING if (v := getattr(body, k.name)) is not None}
    bias = s.logit_bias if body.logit_bias is None else logit_bias(st, body.logit_bias)
    try:  # the values checked, before the grammar's check takes a checker
        sampling = replace(
            s, **given, n_probs=n_probs, post_sampling_probs=post, logit_bias=bias,
            dry_sequence_breakers=s.dry_sequence_breakers if body.dry_sequence_breakers is None
            else tuple(body.dry_sequence_breakers))
    except SamplingError as e:
        raise APIError(400, e.named(e.knob.name), param=e.knob.name,
                       code="invalid_value") from None
    if body.ignore_eos:
        sampling = sampling.banning(st.engine.target.eog)
    # a request that brings no grammar or schema gets the server's (--grammar, -j...)
    sampling = replace(sampling, grammar=grammar(st, body, tools) or s.grammar)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    speculative, spec = spec_of(st, body.speculative)
    id_slot = body.id_slot if body.id_slot is not None and body.id_slot >= 0 else None
    if id_slot is not None and id_slot >= st.config.parallel:
        raise APIError(400, f"id_slot {id_slot} does not exist: this server has "
                       f"{st.config.parallel} slots (0..{st.config.parallel - 1})",
                       param="id_slot")
    return Job(ids, first(n_predict, c.n_predict), sampling, speculative, spec, stop,
               n=getattr(body, "n", None) or 1, return_progress=bool(body.return_progress),
               timings_per_token=bool(body.timings_per_token), id_slot=id_slot)


def grammar(st: State, body: Sampling, tools: tuple[dict, str] | None = None) -> str | None:
    """The request's GBNF: its grammar, or its JSON schema (json_schema, or response_format
    as llama-server reads it: json_object alone is any object) converted, or its tools' call
    (server/tools.py); checked here, so that a bad one is a 400 before a slot is taken."""
    schema, fmt = body.json_schema, getattr(body, "response_format", None)
    if body.grammar is not None and schema is not None:
        raise APIError(400, "cannot use both json_schema and grammar", param="grammar")
    if fmt is not None and fmt.type == "json_object" and (fmt.schema_ is not None or
                                                          not schema):
        schema = fmt.schema_ or {}
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else {}
    if schema is not None and not schema:
        schema = {"type": "object"}  # llama-server: an empty schema means any object
    try:  # in a process of its own, within a deadline and a memory limit (grammar_host)
        gbnf = st.grammars.check(body.grammar if schema is None else None, schema,
                                 tools) if tools is None else st.grammars.check(tools=tools)
    except child.Busy as e:
        raise unavailable(e) from None
    except UsageError as e:
        param = "tools" if tools is not None else "grammar" if body.grammar is not None \
            else "response_format" \
            if fmt is not None and fmt.type != "text" else "json_schema"
        raise APIError(400, e.message, param=param) from None
    return gbnf or None


def logit_bias(st: State, raw: dict | list) -> tuple[tuple[int, float], ...]:
    """llama-server's logit_bias forms as (token, bias) pairs: a key that is a number is a
    token id, any other the tokens of its text; false bans. An id outside the vocabulary
    is refused (engine.check_bias; llama-server drops it silently)."""
    target, out = st.engine.target, {}

    def add(token: int, bias: float) -> None:  # a token named twice: its biases add up, as
        out[token] = out.get(token, 0.0) + bias  # llama.cpp applies each (one entry each)

    for key, value in raw.items() if isinstance(raw, dict) else raw:
        if isinstance(key, bool | float) or isinstance(value, str) or value is True:
            raise APIError(400, "logit_bias: each pair is [token id or text, number or false]",
                           param="logit_bias")
        bias = float("-inf") if value is False else float(value)
        if isinstance(key, int) or re.fullmatch(r"\s*[+-]?[0-9]+\s*", key):
            # (a key of 5,000 digits is past int()'s limit: no vocabulary is that large)
            if not isinstance(key, int) and len(key) >= 32:
                raise APIError(400, f"logit_bias: token id {clip(key.strip(), 40)} is "
                               f"outside the vocabulary (0..{target.n_vocab - 1})",
                               param="logit_bias")
            add(int(key), bias)
        else:
            for t in target.tokenize(key, add_special=False, parse_special=False):
                add(t, bias)
    try:
        check_bias(out, target.n_vocab)
    except UsageError as e:
        raise APIError(400, f"logit_bias: {e.message}", param="logit_bias") from None
    return tuple(out.items())


# each plan setting by its request field (config.PlanError.said), and what to do about it
SPEC_FIELDS = {**{k.field: f"speculative.{k.name}" for k in DRAFTING},
               "types": "speculative.type", "draft": "speculative.type",
               "sampling": "speculative.sampling"}
SPEC_HINTS = {"draft": "start the server with -md", "types": "start the server with -md",
              "n_seq": "start the server with --draft-n-seq N"}


def spec_of(st: State, spec: Speculative | bool | None) -> tuple[bool, SpecRequest | None]:
    """A request's `speculative` object as its own settings, which check themselves, then
    checked against the server's plan: once, here."""
    if spec is None or spec is True:
        return True, None
    if spec is False:
        return False, None
    names = None
    if spec.type is not None:
        try:
            names = parse_spec_types(spec.type)
        except ValueError as e:
            raise APIError(400, f"unknown speculative type {e}: one or more of "
                           f"{', '.join(SPEC_TYPES)}", param="speculative.type") from None
    try:
        return True, st.plan.request(SpecRequest(
            names, **{k.field: getattr(spec, k.name) for k in DRAFTING},
            sampling=spec.sampling))
    except PlanError as e:
        hint = SPEC_HINTS.get(e.field)
        raise APIError(400, e.said(SPEC_FIELDS) + (f": {hint}" if hint else ""),
                       param=SPEC_FIELDS.get(e.field, "speculative")) from None


def settings(st: State, job: Job) -> dict:
    """The request's generation settings as llama-server reports them."""
    return f.settings(job.sampling, job.n_predict, job.stop,
                      st.plan.policy.overlay(job.spec), job.speculative,
                      st.plan.types_of(job.spec))


