"""Hostile files (issue 16, items 2 and 7-10): metadata llama.cpp aborts on, templates that
loop or exhaust memory, NaN weights, a FIFO as a lookup cache. Each is one line and exit 2
within a time bound, never an abort, a hang or garbage with exit 0."""

from __future__ import annotations

import os
import time

import pytest
from conftest import cli, specli
from hostile_models import T, copy_gguf, with_nan, with_template

from specli import chat
from specli.errors import UsageError
from specli.ggufmeta import read_header
from specli.loadable import TOKENS
from specli.template_host import render_messages

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
DOUBLE = ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
          "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}")


def one_line(r, needle: str, code: int = 2) -> None:
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr and "GGML_ASSERT" not in r.stderr


# -- metadata llama.cpp aborts on, or refuses: refused first, by run and check-pair alike --------

U32 = T.UINT32
RULES = {
    "block_count 10^6": ({"llama.block_count": (10**6, U32, None)}, "block_count is 1000000"),
    "block_count 0": ({"llama.block_count": (0, U32, None)}, "block_count is 0"),
    "block_count 513": ({"llama.block_count": (513, U32, None)}, "block_count is 513"),
    "nextn layers": ({"llama.nextn_predict_layers": (31, U32, None)}, "nextn_predict_layers"),
    "head_count 0": ({"llama.attention.head_count": (0, U32, None)}, "head_count has a value"),
    "kv heads do not divide": ({"llama.attention.head_count_kv": (2, U32, None)},
                               "does not divide head_count"),
    "rope dimension": ({"llama.rope.dimension_count": (32, U32, None)},
                       "rope.dimension_count (32)"),
    "rope scaling": ({"llama.rope.scaling.type": ("cubic", T.STRING, None)}, "'cubic'"),
    "experts": ({"llama.expert_count": (2, U32, None), "llama.expert_used_count": (3, U32, None)},
                "expert_used_count (3)"),
    "no vocabulary": ({"tokenizer.ggml.model": ("none", T.STRING, None)}, "tokenizer is 'none'"),
    "short token_type": ({"tokenizer.ggml.token_type": ([1] * 5, T.ARRAY, T.INT32)},
                         "token_type has 5 entries for 49152 tokens"),
    "split part 2": ({"split.count": (2, T.UINT16, None), "split.no": (1, T.UINT16, None)},
                     "part 2 of a split model of 2"),
    "split.no type": ({"split.count": (2, T.UINT16, None), "split.no": (0, T.UINT32, None)},
                      "split.no is UINT32"),
}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, q4_1):
    """Header-only copies of the real Q4_1, each with one rule broken (no weights are read)."""
    d = tmp_path_factory.mktemp("hostile")
    return {name: copy_gguf(q4_1, d / f"{i}.gguf", kv, tensors=False)
            for i, (name, (kv, _)) in enumerate(RULES.items())}


@pytest.mark.parametrize("name", list(RULES))
def test_check_pair_refuses_what_run_cannot_load(hostile, q4_1, name):
    t0 = time.monotonic()
    # metadata only, never llama.cpp's load (which would abort): in this process
    one_line(cli("check-pair", q4_1, hostile[name]), RULES[name][1])
    one_line(cli("check-pair", hostile[name], q4_1, "--json"), RULES[name][1])
    r = cli("info", hostile[name])
    assert r.returncode == 0 and "loadable: no: " in r.stdout
    assert "would abort" in r.stderr
    assert time.monotonic() - t0 < 30


def test_a_duplicated_token_is_refused(tmp_path, q4_1):
    tokens = list(read_header(q4_1, {TOKENS}).kv[TOKENS])
    tokens[100] = tokens[99]
    bad = copy_gguf(q4_1, tmp_path / "dup.gguf",
                    {"tokenizer.ggml.tokens": (tokens, T.ARRAY, T.STRING)}, tensors=False)
    one_line(cli("check-pair", q4_1, bad), "token 100")


@pytest.mark.parametrize("count", [10**6, 513])
def test_run_says_one_line_where_llama_cpp_would_abort(tmp_path, q4_1, count):
    """A full copy, weights and all: without the check, llama.cpp's load aborts (exit 134)."""
    bad = copy_gguf(q4_1, tmp_path / "m.gguf", {"llama.block_count": (count, U32, None)})
    for draft in ((), ("-md", bad)):
        r = specli("run", "-m", q4_1 if draft else bad, *draft, "-p", "hi", "-n", "2")
        one_line(r, f"block_count is {count}")


# -- chat templates: bounded in time and size ----------------------------------------------------

def test_a_template_that_loops_forever_is_stopped():
    t0 = time.monotonic()
    with pytest.raises(UsageError, match="ran for more than 1 s"):
        render_messages(LOOP, [{"role": "user", "content": "hi"}], seconds=1.0)
    assert time.monotonic() - t0 < 3


@pytest.mark.parametrize("template,needle", [
    (DOUBLE, "built a value of"),
    ("{{ 'a' * 10000000000 }}", "repetition"),
    ("{{ 'a'|center(10000000000) }}", "argument of 10000000000"),
    ("{{ 'a'.ljust(10000000000) }}", "argument of 10000000000"),
    ("{{ '{:>10000000000}'.format('a') }}", "format width"),
    ("{{ '%10000000000s' % 'a' }}", "format width"),
    ("{{ '%10000000000s'|format('a') }}", "format width"),
    ("{{ 2 ** 100000000000 }}", "power"),
    ("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}"
     "{% endfor %}", "concatenation"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}" + "x" * 64 +
     "{% endfor %}{% endfor %}", "output passed"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed"),
    # a template may grow its own lists, as llama.cpp's Jinja lets it, within the same bound
    ("{% set x = [1] %}{% for i in range(40) %}{% set _ = x.extend(x) %}{% endfor %}",
     "built a value of"),
    ("{{ [1, 2] | tojson(indent=100000000) }}", "indent"),
])
def test_a_template_that_builds_too_much_is_stopped(template, needle):
    t0 = time.monotonic()
    with pytest.raises(UsageError, match=needle):
        render_messages(template, [{"role": "user", "content": "hi"}])
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("template,needle", [
    ('{{ "%*s" % (100000000, "") }}', "argument of 100000000"),
    ('{% set s = "x" * 5000 %}{{ s.replace("", s) }}', "replacement"),
    ('{% set s = "x" * 5000 %}{{ ([s] * 4000)|join(s) }}', "join"),
    ('{% set s = "x" * 5000 %}{{ s.join([s] * 4000) }}', "join"),
])
def test_sizes_are_judged_before_they_are_built(template, needle):
    with pytest.raises(UsageError, match=needle):
        render_messages(template, [{"role": "user", "content": "hi"}])


def test_what_llama_cpps_jinja_allows_renders():
    """A template's own list grown in place (Kimi K2's), `{% do %}`, transformers'
    `{% generation %}` tag (LFM2.5's, Laguna's), a filtered sequence through tojson
    (llama.cpp's DeepSeek R1 template: `tools | map(attribute='function') | tojson`); the
    lists, dicts and sets the template was handed (messages, tools, prompt's probes) are not
    its to change."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    for change in ("{% do messages.pop() %}", "{% do messages[0].update(content='x') %}",
                   "{% do tools[0].function.clear() %}"):
        with pytest.raises(UsageError, match="unsafe"):
            render_messages(change, messages, context={"tools": [chat.PROBE_TOOL]})
    assert messages[0]["content"] == "hi" and chat.PROBE_TOOL["function"]["name"]
    out = render_messages(
        "{% set ns = namespace(seen=[]) %}{% for m in messages %}"
        "{% set _ = ns.seen.append(m.role) %}{% endfor %}{% do ns.seen.append('end') %}"
        "{{ ns.seen | join(',') }}|{% generation %}{{ messages[-1].content }}{% endgeneration %}"
        "|{{ messages | map(attribute='role') | tojson }}",
        messages, add_generation_prompt=False)
    assert out == 'user,assistant,end|yo|["user", "assistant"]'
    # a list extended by a generator over itself: the generator is read first, bounded (in C,
    # it would never end, past the deadline's reach)
    assert render_messages("{% set x = [1] %}{% do x.extend(x | map('string')) %}{{ x }}",
                           messages) == "[1, '1']"


# one call into a built-in filter over a large sequence (issue 55): in C or in Python no
# trace reaches, each ran for a minute or more at gigabytes before the template's process
SORT = '{{ ("ab" * 8000000) | list | sort | length }}'
FILTER_BOMBS = [SORT, '{{ ("ab" * 8000000) | list | unique | list | length }}',
                '{{ ("ab" * 8000000) | list | batch(2) | list | length }}']
# a list of its own grown by many strings each under the size bound (1.5 GB, answered)
APPENDS = ('{% set ns = namespace(l=[]) %}{% set s = "x" * 16000000 %}'
           '{% for i in range(100) %}{% do ns.l.append(s ~ i) %}{% endfor %}{{ ns.l | length }}')


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith("VmRSS")).split()[1]) / 1024


@pytest.mark.parametrize("template", [*FILTER_BOMBS, APPENDS])
def test_a_filter_call_past_the_budget_is_stopped_in_its_process(template):
    """The deadline and a memory limit hold inside one filter call: the template renders in
    a process of its own (template_host), stopped at its deadline or its memory, and this
    process neither waits nor grows."""
    from specli import template_host

    render_messages("{{ messages[0].content }}", [{"role": "user", "content": "hi"}])
    before, t0 = _rss_mb(), time.monotonic()
    with pytest.raises(UsageError, match="chat template was stopped: it (ran for more than "
                                         "1.5 s|needed more (than|memory))"):
        render_messages(template, [{"role": "user", "content": "hi"}], seconds=1.5)
    assert time.monotonic() - t0 < template_host.GRACE_S + 1.5 + 3
    assert _rss_mb() - before < 100
    # and the next render goes on, in a fresh process where the last one was killed
    assert render_messages("{{ messages[0].content }}",
                           [{"role": "user", "content": "hi"}]) == "hi"


@pytest.mark.parametrize("change", [
    '{% do dict.update(messages[0], {"content": "x"}) %}',
    "{% do dict.update(messages[0], content='x') %}",
    "{% do dict.clear(messages[0]) %}",
    "{% do dict.pop(messages[0], 'role') %}",
    "{% do dict.setdefault(messages[0], 'name', 'x') %}",
    "{% do dict.popitem(messages[0]) %}",
    "{% set d = dict %}{% do d.update(messages[0], role='x') %}",
    "{% do dict.clear(tools[0].function) %}",
    "{% do dict.update(messages[0].tool_calls[0], id='x') %}",
])
def test_a_template_never_changes_what_it_was_handed_in_any_spelling(change):
    """The method form (messages[0].update(...)) was refused; the unbound one
    (dict.update(messages[0], ...)) changed the caller's message. Both are refused, and
    the caller's objects are not the template's anyway (they are copied to its process)."""
    messages = [{"role": "user", "content": "hi", "tool_calls": [{"id": "1", "type":
                                                                  "function"}]}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(UsageError, match="unsafe"):
        render_messages(change, messages, context={"tools": tools})
    assert messages == [{"role": "user", "content": "hi", "tool_calls": [{"id": "1", "type":
                                                                          "function"}]}]
    assert tools == [{"type": "function", "function": {"name": "f"}}]
    # a template's own dicts are its to change, in either spelling
    assert render_messages('{% set d = {"a": 1} %}{% do dict.update(d, b=2) %}'
                           '{{ d | tojson }}', messages) == '{"a": 1, "b": 2}'


def test_a_conversation_nested_too_deep_to_send_is_a_usage_error():
    """A call's arguments nested deep enough parse, then would not encode on their way to
    the templates' process (a RecursionError: a 500)."""
    deep: list = []
    for _ in range(100_000):  # past json's depth on any Python (3.12 goes deeper than 3.11)
        deep = [deep]
    with pytest.raises(UsageError, match="nests too deeply"):
        render_messages("{{ messages | length }}", [{"role": "user", "content": "x",
                                                     "a": deep}])
    from specli.prompt import _gemma4_turns  # a tool result's text too deep to be JSON

    out = _gemma4_turns([{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]},
                         {"role": "tool", "content": "[" * 5000 + "]" * 5000}])
    assert out[0]["tool_responses"][0]["response"] == "[" * 5000 + "]" * 5000


def test_a_final_message_of_blocks_is_continued_where_its_text_ends():
    """A template that reads content blocks (Ministral 3's, with the turn's reasoning as a
    block before the text): the prefill continues the text block, not the blocks' repr."""
    template = ("{% for m in messages %}{% if m.content is string %}{{ m.content }}"
                "{% else %}{% for b in m.content %}[{{ b.type }}:{{ b.text or b.thinking }}]"
                "{% endfor %}{% endif %}{% endfor %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "t"}, {"type": "text", "text": "Hello"}]}]
    assert render_messages(template, messages, continue_final=True) == \
        "hi[thinking:t][text:Hello"


def test_large_numbers_are_values_not_widths():
    """Only widths and counts are bounded: ids and timestamps in tool calls render."""
    out = render_messages('{{ 123456789012|tojson }} {{ "%d"|format(123456789012) }} '
                          '{{ "{}".format(123456789012) }} {{ "a-b".replace("-", "+") }}',
                          [{"role": "user", "content": "hi"}])
    assert out == "123456789012 123456789012 123456789012 a+b"


def test_a_conversation_longer_than_the_context_is_a_context_error():
    from specli.errors import ContextOverflowError

    joined = "{% for m in messages %}{{ m.role ~ ': ' ~ m.content ~ '\\n' }}{% endfor %}"
    with pytest.raises(ContextOverflowError):
        render_messages(joined, [{"role": "user", "content": "x" * 5000}], max_bytes=1000)


def test_real_templates_render_as_before(q4_1):
    from specli.backend import Model
    from specli.config import ModelParams

    m = Model(ModelParams(q4_1, n_ctx=256))
    try:
        text = render_messages(m.chat_template(), [
            {"role": "system", "content": "be brief 12345678901234567890"},
            {"role": "user", "content": "%s {} {:>5} ~ ** " * 50}])
    finally:
        m.close()
    assert text.startswith("<|im_start|>system\nbe brief 12345678901234567890<|im_end|>")
    assert "%s {} {:>5} ~ ** " * 50 in text


@pytest.mark.parametrize("template,needle,limit", [
    (LOOP, "ran for more than 5 s", 12),
    (DOUBLE, "built a value of", 10),
    # in one filter call: 85 s at 3 GB before this issue
    (SORT, "chat template was stopped: it ", 15),
])
def test_run_chat_with_a_hostile_template_is_one_line(tmp_path, q4_1, template, needle, limit):
    bad = with_template(q4_1, tmp_path / "t.gguf", template)
    t0 = time.monotonic()
    r = specli("run", "-m", bad, "--no-spec", "-p", "hi", "--chat", "-n", "2")
    one_line(r, needle)
    assert "chat template" in r.stderr and r.stdout == ""
    assert time.monotonic() - t0 < limit


# -- NaN weights ---------------------------------------------------------------------------------

def test_nan_logits_are_an_error_not_garbage(tmp_path, q4_1):
    bad = with_nan(q4_1, tmp_path / "nan.gguf")
    r = specli("run", "-m", bad, "--no-spec", "-p", "hi", "-n", "4")
    one_line(r, "produced NaN or infinite logits at token 1")
    r = specli("run", "-m", q4_1, "-md", bad, "-p", "hi", "-n", "4", "--temp", "0.8")
    assert r.returncode == 2 and "draft model produced NaN" in r.stderr, r.stderr


# -- lookup caches -------------------------------------------------------------------------------

def test_a_fifo_is_not_a_lookup_cache(tmp_path, q4_1):
    fifo = tmp_path / "f.bin"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    one_line(specli("lookup", "stats", str(fifo), timeout=30), "not a regular file")
    r = specli("run", "-m", q4_1, "--spec-type", "ngram-cache", "-lcs", str(fifo), "-p", "hi",
               "-n", "2", timeout=30)
    one_line(r, "not a regular file")
    assert time.monotonic() - t0 < 20


def test_an_unwritable_dynamic_cache_fails_before_generating(tmp_path, q4_1):
    for path in ("/proc/specli-cache.bin", str(tmp_path / "no" / "such" / "dir.bin"),
                 str(tmp_path)):
        r = specli("run", "-m", q4_1, "--spec-type", "ngram-cache", "-lcd", path, "-p", "hi",
                   "-n", "8")
        one_line(r, "lookup cache")
        assert r.stdout == ""  # nothing was generated, so nothing is lost


def test_serve_says_one_line_for_a_file_it_cannot_load(hostile):
    t0 = time.monotonic()
    r = specli("serve", "-m", hostile["block_count 513"], "--port", "0", timeout=60)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "block_count is 513" in errors[0], r.stderr
    assert "Traceback" not in r.stderr and time.monotonic() - t0 < 30


def test_what_llama_cpp_loads_is_not_refused(tmp_path, q4_1):
    """The first part of a split model, a recurrent model without attention heads, longer
    per-token arrays: llama.cpp loads these, so the checks let them through."""
    from specli import loadable

    n = len(read_header(q4_1, {TOKENS}).kv[TOKENS])
    for i, kv in enumerate([
        {"split.count": (2, T.UINT16, None), "split.no": (0, T.UINT16, None)},
        {"llama.attention.head_count": (9, U32, None),
         "tokenizer.ggml.scores": ([0.0] * (n + 3), T.ARRAY, T.FLOAT32)},
    ]):
        assert loadable.problem(copy_gguf(q4_1, tmp_path / f"{i}.gguf", kv, tensors=False)) \
            is None
    mamba = copy_gguf(q4_1, tmp_path / "m.gguf", {
        "general.architecture": ("mamba", T.STRING, None),
        "mamba.block_count": (2, U32, None), "mamba.attention.head_count": (0, U32, None)},
        tensors=False)
    assert loadable.problem(mamba) is None
