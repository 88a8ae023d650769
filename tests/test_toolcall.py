"""Tool calls and reasoning read back per template family (toolcall.py), on answers as the
models write them: the outputs llama.cpp's own tests/test-chat.cpp parses for each template in
models/templates/, and the same split when the answer arrives token by token."""

from __future__ import annotations

import json
import re

import pytest

from specli import toolcall
from specli.toolcall import GENERIC, family, parse
from specli.toolstream import Splitter

TOOLS = [{"type": "function", "function": {
    "name": "special_function", "parameters": {
        "type": "object", "properties": {"arg1": {"type": "integer"}}, "required": ["arg1"]}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = ("special_function", {"arg1": 1})
HELLO = "Hello, world!\nWhat's up?"

# the families by a telling piece of their template's text
TEMPLATE = {
    "hermes": "{{- '<tool_call>\\n' }}{{ tool_call.arguments | tojson }}",
    "qwen3-coder": "<tool_call>\n<function={{ name }}>\n<parameter={{ k }}>",
    "llama3": "<|start_header_id|>ipython<|end_header_id|> \"parameters\": ",
    "mistral-nemo": "[TOOL_CALLS][{{ tool_calls | tojson }}]",
    "mistral-small": "[TOOL_CALLS]{{ name }}[CALL_ID]{{ id }}[ARGS]",
    "ministral": "[SYSTEM_PROMPT][TOOL_CALLS]{{ name }}[ARGS]",
    "deepseek-r1": "<｜tool▁calls▁begin｜>function<｜tool▁sep｜>\n```json\n",
    "deepseek-v3.1": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{{ name }}<｜tool▁sep｜>",
    "command-r7b": "<|START_THINKING|><|START_ACTION|>",
    "gpt-oss": "<|start|>assistant<|channel|>final<|message|>",
    "gemma4": "'<|tool_call>call:' + name",
    "kimi-k2": "<|tool_calls_section_begin|><|tool_call_begin|>",
    "glm": "<tool_call>{{ name }}<arg_key>{{ k }}</arg_key>",
    "minimax-m2": "<minimax:tool_call>",
    "firefunction-v2": " functools[{{ calls }}]",
    "functionary-v3.1": "<function={{ name }}>",
    "functionary-v3.2": "{{ '>>>all\\n' }}{{ '>>>${recipient}\\n' }}",
    "apertus": "<|tools_prefix|>",
    "lfm2": "<|tool_list_start|>",
}

# (family, what the model wrote, content, reasoning, calls [(name, arguments, id or None)])
CASES = [
    ("hermes", '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>',
     "", "", [CALL]),
    ("hermes", HELLO + '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}'
     "</tool_call>", HELLO, "", [CALL]),
    ("hermes", "<think>I'm\nthinking</think>" + HELLO, HELLO, "I'm\nthinking", []),
    ("hermes", '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n'
     "</tool_call>", "", "", [CALL, ("get_time", {"city": "Paris"})]),
    ("qwen3-coder", "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n"
     "</parameter>\n</function>\n</tool_call>", "", "", [CALL]),
    ("qwen3-coder", "<tool_call>\n<function=get_time>\n<parameter=city>\n42\n</parameter>\n"
     "</function>\n</tool_call>", "", "", [("get_time", {"city": "42"})]),  # a string by schema
    ("llama3", '{"name": "special_function", "parameters": {"arg1": 1}}', "", "", [CALL]),
    ("llama3", HELLO, HELLO, "", []),
    ("mistral-nemo", '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, '
     '"id": "123456789"}]', "", "", [(*CALL, "123456789")]),
    ("mistral-small", "[TOOL_CALLS]special_function[CALL_ID]000000001[ARGS]{\"arg1\": 1}"
     "[TOOL_CALLS]get_time[CALL_ID]000000002[ARGS]{\"city\": \"Paris\"}", "", "",
     [(*CALL, "000000001"), ("get_time", {"city": "Paris"}, "000000002")]),
    ("ministral", HELLO + '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}', HELLO, "", [CALL]),
    ("ministral", "[THINK]I'm\nthinking[/THINK]" + HELLO, HELLO, "I'm\nthinking", []),
    ("deepseek-r1", "I'm\nthinking</think>" + HELLO, HELLO, "I'm\nthinking", []),
    ("deepseek-r1", "</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
     "special_function\n```json\n{\"arg1\": 1}```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "", "", [CALL]),
    ("deepseek-v3.1", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>"
     '{"city": "XYZCITY"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "", "",
     [("get_time", {"city": "XYZCITY"})]),
    ("command-r7b", "<|START_THINKING|>I'm\nthinking<|END_THINKING|><|START_RESPONSE|>" + HELLO
     + "<|END_RESPONSE|>", HELLO, "I'm\nthinking", []),
    ("command-r7b", "<|START_THINKING|>I'm\nthinking<|END_THINKING|><|START_ACTION|>[\n"
     '    {"tool_call_id": "0", "tool_name": "special_function", "parameters": {"arg1": 1}}\n'
     "]<|END_ACTION|>", "", "I'm\nthinking", [(*CALL, "0")]),
    ("gpt-oss", "<|channel|>final<|message|>" + HELLO, HELLO, "", []),
    ("gpt-oss", "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant"
     "<|channel|>final<|message|>" + HELLO, HELLO, "I'm\nthinking", []),
    ("gpt-oss", "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant"
     "<|channel|>commentary to=functions.special_function <|constrain|>json<|message|>"
     '{"arg1": 1}', "", "I'm\nthinking", [CALL]),
    ("gemma4", "<|channel>thought\nI'm\nthinking<channel|>" + HELLO, HELLO, "\nI'm\nthinking",
     []),
    ("gemma4", '<|tool_call>call:get_time{city:<|"|>London<|"|>}<tool_call|>', "", "",
     [("get_time", {"city": "London"})]),
    ("kimi-k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.special_function:0"
     '<|tool_call_argument_begin|>{"arg1": 1}<|tool_call_end|><|tool_calls_section_end|>',
     "", "", [(*CALL, "functions.special_function:0")]),
    ("glm", "<tool_call>special_function\n<arg_key>arg1</arg_key>\n<arg_value>1</arg_value>\n"
     "</tool_call>", "", "", [CALL]),
    ("minimax-m2", 'I\'m\nthinking\n</think>\n\n<minimax:tool_call>\n<invoke name="'
     'special_function">\n<parameter name="arg1">1</parameter>\n</invoke>\n'
     "</minimax:tool_call>", "", "I'm\nthinking\n", [CALL]),
    ("firefunction-v2", ' functools[{"name": "special_function", "arguments": {"arg1": 1}}]',
     "", "", [CALL]),
    ("functionary-v3.1", '<function=special_function>{"arg1": 1}</function>', "", "", [CALL]),
    ("functionary-v3.2", "all\n" + HELLO, HELLO, "", []),
    ("functionary-v3.2", 'special_function\n{"arg1": 1}', "", "", [CALL]),
    ("functionary-v3.2", 'all\nLet me see.\n>>>special_function\n{"arg1": 1}>>>get_time\n'
     '{"city": "Paris"}', "Let me see.\n", "", [CALL, ("get_time", {"city": "Paris"})]),
    ("functionary-v3.2", HELLO, HELLO, "", []),  # a model that writes no recipient
    ("functionary-v3.2", 'get_time\n{"city": ">>> Paris"}>>>all\nDone.',  # >>> in its JSON
     "Done.", "", [("get_time", {"city": ">>> Paris"})]),
    ("apertus", '<|tools_prefix|>[{"special_function": {"arg1": 1}}]<|tools_suffix|>', "", "",
     [CALL]),
    ("lfm2", "<think>I need the time</think>Let me check.<|tool_call_start|>"
     '[get_time(city="Paris")]<|tool_call_end|>', "Let me check.", "I need the time",
     [("get_time", {"city": "Paris"})]),
    ("generic", '{"tool_calls": [{"name": "special_function", "arguments": {"arg1": 1}}]}',
     "", "", [CALL]),
    ("generic", '{"response": "Hello, \\"world\\"!"}', 'Hello, "world"!', "", []),
    ("generic", HELLO, HELLO, "", []),
]


def _fam(name: str):
    fam = GENERIC if name == "generic" else family(TEMPLATE[name], renders_calls=True)
    assert fam.name == name
    return fam


def _calls(parsed) -> list:
    return [(c.name, json.loads(c.arguments), c.id) for c in parsed.calls]


def _want(calls) -> list:
    return [(c[0], c[1], c[2] if len(c) > 2 else None) for c in calls]


def _forced(name: str, text: str) -> bool:
    """DeepSeek R1's and MiniMax's templates open <think> in the generation prompt."""
    return name in ("deepseek-r1", "minimax-m2")


@pytest.mark.parametrize("name,text,content,reasoning,calls", CASES)
def test_each_family_reads_as_llama_cpp_reads_it(name, text, content, reasoning, calls):
    fam = _fam(name)
    p = parse(fam, text, TOOLS, forced_open=_forced(name, text))
    assert (p.content.strip(), p.reasoning) == (content.strip(), reasoning)
    got = _calls(p)
    assert [(n, a) for n, a, _ in got] == [(n, a) for n, a, _ in _want(calls)]
    for (_, _, i), (_, _, want) in zip(got, _want(calls), strict=True):
        # a generated id: OpenAI's call_ form, as its clients show it, or the family's own
        assert i == want if want is not None else re.fullmatch(
            r"call_[A-Za-z0-9]{24}" if fam.id_length is None else
            f"[A-Za-z0-9]{{{fam.id_length}}}", i)


@pytest.mark.parametrize("name,text,content,reasoning,calls", CASES)
def test_a_stream_splits_the_same_token_by_token(name, text, content, reasoning, calls):
    """Fed a few characters at a time, the deltas add up to the whole answer's reading, and
    nothing sent is a piece of a marker (no delta is ever taken back)."""
    fam = _fam(name)
    whole = parse(fam, text, TOOLS, forced_open=_forced(name, text))
    s = Splitter(fam, TOOLS, forced_open=_forced(name, text))
    got_content, got_reasoning, got_calls = "", "", []
    for i in range(0, len(text), 3):
        d = s.feed(text[i:i + 3])
        got_content, got_reasoning = got_content + d.content, got_reasoning + d.reasoning
        got_calls += d.calls
        for marker in (*fam.openers, "<think>", "</think>", "<|", "[TOOL_CALLS]"):
            if marker in text and marker not in content:
                assert marker not in got_content, (marker, got_content)
    d = s.finish()
    got_content, got_reasoning = got_content + d.content, got_reasoning + d.reasoning
    got_calls += d.calls
    assert (got_content, got_reasoning) == (whole.content, whole.reasoning)
    assert [(c.name, c.arguments) for c in got_calls] == \
        [(c.name, c.arguments) for c in whole.calls]


LONG = "x = [1, 2] if a < b else {'k': 3}\n" * 120  # past toolstream.SMALL


def _streams(fam, text, sizes, **kw) -> tuple[str, str, list]:
    s = Splitter(fam, TOOLS, **kw)
    content, reasoning, calls, i, k = "", "", [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        d = s.feed(text[i:i + n])
        content, reasoning, calls, i, k = (content + d.content, reasoning + d.reasoning,
                                           calls + list(d.calls), i + n, k + 1)
    d = s.finish()
    return content + d.content, reasoning + d.reasoning, calls + list(d.calls)


@pytest.mark.parametrize("fmt,parse_calls", [("deepseek", True), ("none", True),
                                             ("deepseek", False)])
@pytest.mark.parametrize("name,text,content,reasoning,calls", CASES)
def test_a_stream_in_any_pieces_adds_up_to_the_whole_reading(name, text, content, reasoning,
                                                              calls, fmt, parse_calls):
    """The stream's reader keeps its place (toolstream): in pieces of any size, with blanks
    before the answer, long text before and inside it (past the size up to which a region is
    read again whole at every piece), every reading option, its deltas add up to the
    finished answer's reading, calls and their ids included."""
    fam = _fam(name)
    kw = dict(forced_open=_forced(name, text), reasoning_format=fmt, parse_calls=parse_calls)
    variants = [text, "  \n" + text, text.replace("thinking", "thinking " + LONG)]
    if name != "functionary-v3.2":  # (a call with text after it is none; a stream sends it
        variants.append(text + LONG)  # once complete, before the text comes)
    if name != "gpt-oss":  # (harmony: text before the first header is no message; a stream
        variants.append(LONG + text)  # sends it as the answer before it knows)
    for t in variants:
        for sizes in ([1], [3], [2, 7, 1, 64], [5000]):
            s_content, s_reasoning, s_calls = _streams(fam, t, sizes, **kw)
            whole = parse(fam, t, TOOLS, final=True, **kw)
            assert (s_content, s_reasoning) == (whole.content, whole.reasoning), (t[:60], sizes)
            assert [(c.name, c.arguments) for c in s_calls] == \
                [(c.name, c.arguments) for c in whole.calls], (t[:60], sizes)
            assert all(c.id for c in s_calls) and len({c.id for c in s_calls}) == len(s_calls)
    # and it streams: one character a piece, the content and the reasoning come before the
    # end, but for what may still become a marker (a tail) or is read whole once complete
    s = Splitter(fam, TOOLS, **kw)
    got = [s.feed(c) for c in text + LONG]
    whole = parse(fam, text + LONG, TOOLS, final=True, **kw)
    early = "".join(d.content + d.reasoning for d in got)
    # (read whole: Functionary v3.2, GPT-OSS with reasoning_format none, a GPT-OSS call)
    whole_read = name == "functionary-v3.2" or name == "gpt-oss" and fmt == "none" or \
        "to=functions" in text
    if not whole_read and (whole.calls or not parse_calls or not any(
            o in text for o in fam.openers)):
        assert len(early) >= len(whole.content + whole.reasoning) - 40, (early[-80:], fmt)


def test_an_opener_written_in_the_reasoning_is_no_call_in_a_stream():
    """The call region is looked for after the reasoning only, however the pieces fall."""
    fam = _fam("kimi-k2")  # (openers of two lengths: the shorter one just before </think>)
    text = "<think>I could write <|tool_call_begin|></think>" + HELLO
    for n in (1, 2, 5):
        s = Splitter(fam, TOOLS)
        got = [s.feed(text[i:i + n]) for i in range(0, len(text), n)]  # before finish
        assert "".join(d.content for d in got) == HELLO, n
        assert "".join(d.reasoning for d in got) == "I could write <|tool_call_begin|>"


def test_tool_choice_none_streams_no_gpt_oss_call():
    """parse_calls off (tool_choice none): a GPT-OSS call's message, ended, is no call in a
    stream either (it was sent as one, by the stream alone)."""
    fam = _fam("gpt-oss")
    text = ("<|channel|>commentary to=functions.special_function <|constrain|>json<|message|>"
            '{"arg1": 1}<|call|>')
    s = Splitter(fam, TOOLS, parse_calls=False)
    assert all(d.calls == () for d in [*(s.feed(c) for c in text), s.finish()])


def test_reasoning_format_none_keeps_the_thinking_in_the_content():
    fam = _fam("hermes")
    text = "<think>I'm\nthinking</think>" + HELLO
    assert parse(fam, text, reasoning_format="none").content == text
    assert parse(fam, "I'm\nthinking</think>" + HELLO, forced_open=True,
                 reasoning_format="none").content == text


def test_an_answer_cut_short_inside_its_thinking_is_all_reasoning():
    p = parse(_fam("hermes"), "<think>I'm still thin", TOOLS)
    assert (p.content, p.reasoning) == ("", "I'm still thin")


def test_an_opener_that_begins_no_call_is_text():
    text = "Use <tool_call> tags like this."
    assert parse(_fam("hermes"), text, TOOLS).content == text


def test_parse_calls_off_reads_everything_as_content():
    """tool_choice none: the tools are shown to the model, its answer is not read for calls."""
    text = '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>'
    p = parse(_fam("hermes"), text, TOOLS, parse_calls=False)
    assert (p.content, p.calls) == (text, ())


def test_the_generic_response_streams_as_it_is_written():
    s = Splitter(GENERIC, TOOLS)
    out = "".join(s.feed(c).content for c in '{"response": "Hi \\u00e9\\n there"}')
    assert out + s.finish().content == "Hi é\n there"


HOSTILE = {  # what a model may be led to write: no call in any of them
    "nesting deeper than json's decoder": '<tool_call>[TOOL_CALLS] functools' + "[" * 100_000,
    "an object never closed": '{"response": ' + '{"a": ' * 50_000,
    "a marker then blanks": "[TOOL_CALLS]" + " " * 20_000 + "<tool_call>" + " " * 20_000,
    "lists that never close around objects": ("[{}," + "1," * 100) * 200,
    "openers without closers": "".join(
        f"{o}x{{" for o in ("<tool_call>", "<function=", "<|tool_call>call:", "[TOOL_CALLS]",
                            "<|tool_call_start|>", '<invoke name="x">', toolcall.DS_CALL,
                            "<|channel|>commentary to=functions.x<|message|>")) * 500,
}


@pytest.mark.parametrize("what", list(HOSTILE))
@pytest.mark.parametrize("name", [*TEMPLATE, "generic"])
def test_a_hostile_answer_is_text_in_every_family(name, what):
    """Nothing in an answer breaks its reading: no exception (a nesting too deep for
    json's decoder is no call), no call made up (a hostile stream's cost is
    scripts/bench_toolcall.py's)."""
    fam, text = _fam(name), HOSTILE[what]
    assert parse(fam, text, TOOLS).calls == ()
    s = Splitter(fam, TOOLS)
    got = [s.feed(text[i:i + 4096]) for i in range(0, len(text), 4096)] + [s.finish()]
    assert all(d.calls == () for d in got)


# a call of special_function in each family, its argument's value to fill in
VALUE_AT = {name: text for name, text, _, _, calls in reversed(CASES) if calls == [CALL]}
VALUE_AT = {name: text.replace('"arg1": 1}', '"arg1": {V}}').replace(
    "<parameter=arg1>\n1\n", "<parameter=arg1>\n{V}\n").replace(
    "<arg_value>1</arg_value>", "<arg_value>{V}</arg_value>").replace(
    '<parameter name="arg1">1</parameter>', '<parameter name="arg1">{V}</parameter>')
    for name, text in VALUE_AT.items()}
VALUE_AT["gemma4"] = "<|tool_call>call:special_function{arg1:{V}}<tool_call|>"
VALUE_AT["lfm2"] = "<|tool_call_start|>[special_function(arg1={V})]<|tool_call_end|>"
TAGGED = ("qwen3-coder", "glm", "minimax-m2", "lfm2")  # a value as written stays a string
# what a model led by a prompt injection may write where a value goes: Python that only
# Python reads, numbers JSON has no form for, nesting past the decoders' depth
NO_JSON = {"complex": "1j", "set": "{1, 2}", "ellipsis": "...",
           "3,700 hex digits": "0x" + "f" * 3700, "NaN": "NaN", "overflow": "1e999",
           "minus infinity": "-Infinity", "5,000 digits": "9" * 5000,
           "100,000 brackets": "[" * 100_000 + "]" * 100_000, "10,000 braces": "{" * 10_000}


def _strict(text: str):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in {text[:80]}"))


@pytest.mark.parametrize("value", list(NO_JSON))
@pytest.mark.parametrize("name", list(VALUE_AT))
def test_a_value_without_a_json_form_is_never_an_error(name, value):
    """A model's own answer never makes its reading fail (it was a 500, and a stream that
    ended without [DONE]): a value with no JSON form stays the text it was where the
    family writes values as text (the tag families, LFM2's Python), and is no call where
    the family writes JSON; every call read is strict JSON."""
    fam, text = _fam(name), VALUE_AT[name].replace("{V}", NO_JSON[value])
    p = parse(fam, text, TOOLS, forced_open=_forced(name, text))
    s = Splitter(fam, TOOLS, forced_open=_forced(name, text))
    streamed = [c for i in range(0, len(text), 997) for c in s.feed(text[i:i + 997]).calls]
    streamed += s.finish().calls
    assert [c.arguments for c in streamed] == [c.arguments for c in p.calls]
    for c in p.calls:
        args = _strict(c.arguments)
        assert isinstance(args, dict) and _strict(json.dumps(args)) == args
    # (LFM2's call is Python: one Python cannot parse whole is no call)
    unparsed = ("10,000 braces",) + (("5,000 digits", "100,000 brackets") if name == "lfm2"
                                     else ())
    if name in TAGGED and value not in unparsed:
        assert [(c.name, _strict(c.arguments)) for c in p.calls] == \
            [("special_function", {"arg1": NO_JSON[value]})]


@pytest.mark.parametrize("name,text", [
    ("generic", '{"tool_calls": [{"name": "special_function", "arguments": "not json"}]}'),
    ("generic", '{"tool_calls": [{"name": "special_function", "arguments": [1]}]}'),
    ("hermes", '<tool_call>\n{"name": "special_function", "arguments": 7}</tool_call>'),
    ("mistral-small", '[TOOL_CALLS]special_function[CALL_ID]000000001[ARGS]"text"'),
    ("gpt-oss", "<|channel|>commentary to=functions.special_function <|constrain|>json"
     '<|message|>{"arg1": 1} and more<|call|>'),
])
def test_arguments_that_are_no_object_make_no_call(name, text):
    """A call's arguments are a JSON object (or OpenAI's text of one): text, an array, a
    number, or an object with more after it is no call, and stays text; beside a good call,
    neither is a call (the region is text, as it was written)."""
    fam = _fam(name)
    p = parse(fam, text, TOOLS)
    body = text.split("<|message|>")[-1].removesuffix("<|call|>")  # (harmony: the message)
    assert p.calls == () and p.content.strip() == (body if name == "gpt-oss" else text), p
    if name == "hermes":
        good = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}</tool_call>'
        p = parse(fam, good + text, TOOLS)
        assert p.calls == () and p.content == good + text, p


def test_a_lone_surrogate_a_model_spells_never_reaches_the_client():
    """JSON lets a model spell "\\ud800"; no UTF-8 encoder takes it (it was a 500 when the
    reply was written): a replacement character, whole and streamed, and a pair split
    across pieces is held until its second half comes."""
    fam = _fam("generic")
    for text, want in (('{"response": "a\\ud800b"}', "a\ufffdb"),
                       ('{"response": "\\ud83d\\ude00!"}', "\U0001f600!")):
        assert parse(fam, text).content == want
        s = Splitter(fam)
        assert "".join(s.feed(c).content for c in text) + s.finish().content == want
    call = '{"tool_calls": [{"name": "get_time", "arguments": {"city": "\\udc00"}}]}'
    args = parse(fam, call, TOOLS).calls[0].arguments
    assert args.encode("utf-8") and _strict(args) == {"city": "\ufffd"}


def test_a_family_without_tool_calls_in_its_template_is_generic():
    assert family("{% for m in messages %}{{ m.content }}{% endfor %}", False) is GENERIC


# a required call in each family with a grammar, as the grammar lets the model write it
GRAMMAR_TEXT = {
    "ministral": '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}',
    "gpt-oss": "<|channel|>commentary to=functions.special_function <|constrain|>json"
               '<|message|>{"arg1": 1}',
    "kimi-k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.special_function:0"
               '<|tool_call_argument_begin|>{"arg1": 1}<|tool_call_end|>'
               "<|tool_calls_section_end|>",
    "deepseek-r1": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                   'special_function\n```json\n{"arg1": 1}\n```<｜tool▁call▁end｜>'
                   "<｜tool▁calls▁end｜>",
    "deepseek-v3.1": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>special_function<｜tool▁sep｜>"
                     '{"arg1": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "command-r7b": '<|START_ACTION|>[{"tool_name": "special_function", "parameters": '
                   '{"arg1": 1}}]<|END_ACTION|>',
    "mistral-small": '[TOOL_CALLS]special_function[CALL_ID]123456789[ARGS]{"arg1": 1}',
    "mistral-nemo": '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, '
                    '"id": "123456789"}]',
    "firefunction-v2": ' functools[{"name": "special_function", "arguments": {"arg1": 1}}]',
    "functionary-v3.1": '<function=special_function>{"arg1": 1}</function>',
    "functionary-v3.2": 'special_function\n{"arg1": 1}',
    "hermes": '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n'
              "</tool_call>",
    "llama3": '{"name": "special_function", "parameters": {"arg1": 1}}',
    "qwen3-coder": "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n"
                   "</parameter>\n</function>\n</tool_call>",
    "glm": "<tool_call>special_function\n<arg_key>arg1</arg_key>\n<arg_value>1</arg_value>\n"
           "</tool_call>",
    "minimax-m2": '<minimax:tool_call>\n<invoke name="special_function">\n<parameter '
                  'name="arg1">1</parameter>\n</invoke>\n</minimax:tool_call>',
    "gemma4": "<|tool_call>call:special_function{arg1:1}<tool_call|>",
    "lfm2": "<|tool_call_start|>[special_function(arg1=1)]<|tool_call_end|>",
    "generic": '{"tool_calls": [{"name": "special_function", "arguments": {"arg1": 1}}]}',
}


def test_every_family_with_a_grammar_is_listed():
    assert set(GRAMMAR_TEXT) == {f.name for _, f in toolcall.FAMILIES
                                 if f.call_gbnf is not None or f.call_params is not None
                                 } | {"generic"}


@pytest.mark.parametrize("name", sorted(GRAMMAR_TEXT))
def test_a_required_call_grammar_takes_the_familys_call_and_ends_there(name, q4_1):
    """The grammar of a required call (the tools' schemas through llama.cpp's converter, the
    family's markers around them) is GBNF llama.cpp parses; it lets the model write the
    family's call token by token, then end; the call it took reads back as that call."""
    import numpy as np

    from specli.backend import Grammar, Tokenizer, schemas_grammar
    from specli.ggufmeta import read_header

    fam = _fam(name)
    schemas, root, _ = toolcall.grammar_parts(fam, TOOLS, required=True, parallel=False)
    text = GRAMMAR_TEXT[name]
    tok = Tokenizer(q4_1)
    try:
        g = Grammar(tok, schemas_grammar(schemas, root))
        for t in tok.tokenize(text, add_special=False, parse_special=False):
            assert g.allowed(np.array([t], dtype=np.int32))[0], (name, tok.detokenize([t]))
            g.accept(t)
        eos = read_header(q4_1).kv["tokenizer.ggml.eos_token_id"]
        assert g.allowed(np.array([eos], dtype=np.int32))[0]  # the call is whole: it may end
        other = tok.tokenize("Hello", add_special=False, parse_special=False)[0]
        assert not Grammar(tok, schemas_grammar(schemas, root)).allowed(
            np.array([other], dtype=np.int32))[0]  # no free text first: a call is required
    finally:
        tok.close()
    assert _calls(parse(fam, text, TOOLS))[0][:2] == CALL


# the families that write a parameter at a time: (a call with a string parameter, a call
# whose integer is no integer, two calls as the family writes them in one answer)
TAGGED_GRAMMAR = {
    "gemma4": (
        '<|tool_call>call:get_time{city:<|"|>New York<|"|>}<tool_call|>',
        "<|tool_call>call:special_function{arg1:x",
        "<|tool_call>call:special_function{arg1:1}<tool_call|><|tool_call>call:get_time{}"
        "<tool_call|>"),
    "lfm2": (
        '<|tool_call_start|>[get_time(city="New York")]<|tool_call_end|>',
        "<|tool_call_start|>[special_function(arg1=x",
        "<|tool_call_start|>[special_function(arg1=1), get_time()]<|tool_call_end|>"),
    "qwen3-coder": (
        "<tool_call>\n<function=get_time>\n<parameter=city>\nNew York\n</parameter>\n"
        "</function>\n</tool_call>",
        "<tool_call>\n<function=special_function>\n<parameter=arg1>\nx",
        "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n"
        "</tool_call>"),
    "glm": (
        "<tool_call>get_time\n<arg_key>city</arg_key>\n<arg_value>New York</arg_value>\n"
        "</tool_call>",
        "<tool_call>special_function\n<arg_key>arg1</arg_key>\n<arg_value>x",
        "<tool_call>special_function\n<arg_key>arg1</arg_key>\n<arg_value>1</arg_value>\n"
        "</tool_call>\n<tool_call>get_time\n</tool_call>"),
    "minimax-m2": (
        '<minimax:tool_call>\n<invoke name="get_time">\n<parameter name="city">New York'
        "</parameter>\n</invoke>\n</minimax:tool_call>",
        '<minimax:tool_call>\n<invoke name="special_function">\n<parameter name="arg1">x',
        '<minimax:tool_call>\n<invoke name="special_function">\n<parameter name="arg1">1'
        '</parameter>\n</invoke>\n<invoke name="get_time">\n</invoke>\n'
        "</minimax:tool_call>"),
}


def _walk(tok, gbnf: str, text: str, special: bool = False):
    """The grammar after `text` was written into it token by token (its tokens by `tok`),
    or None where it refuses one."""
    import numpy as np

    from specli.backend import Grammar

    g = Grammar(tok, gbnf)
    for t in tok.tokenize(text, add_special=False, parse_special=special):
        if not g.allowed(np.array([t], dtype=np.int32))[0]:
            return None
        g.accept(t)
    return g


def _taker(q4_1):
    """takes(tools, fam, text, parallel): whether a required call's grammar lets the model
    write `text` token by token and end there; close() when done."""
    import numpy as np

    from specli.backend import Tokenizer, schemas_grammar
    from specli.ggufmeta import read_header

    tok = Tokenizer(q4_1)
    eos = read_header(q4_1).kv["tokenizer.ggml.eos_token_id"]

    def takes(tools, fam, text: str, parallel: bool = False) -> bool:
        schemas, root, _ = toolcall.grammar_parts(fam, tools, True, parallel)
        g = _walk(tok, schemas_grammar(schemas, root), text)
        return g is not None and bool(g.allowed(np.array([eos], dtype=np.int32))[0])

    return takes, tok.close


@pytest.mark.parametrize("name", sorted(TAGGED_GRAMMAR))
def test_a_tagged_familys_call_grammar_types_each_parameter(name, q4_1):
    """Qwen3-Coder, GLM and MiniMax write a tag per parameter, Gemma 4 and LFM2 a key per
    parameter: a string parameter is its text (Gemma 4's between <|"|>, LFM2's a string
    literal), any other is JSON by its own schema (an integer refuses "x"), an optional one
    may be left out, and parallel calls follow each other as the family writes them; what
    the grammar took reads back as those calls."""
    fam = _fam(name)
    text, bad, two = TAGGED_GRAMMAR[name]  # (repeat's fix: a second call of another tool)
    takes, close = _taker(q4_1)
    try:
        assert takes(TOOLS, fam, text)
        assert not takes(TOOLS, fam, bad)
        assert takes(TOOLS, fam, two, parallel=True) and not takes(TOOLS, fam, two)
    finally:
        close()
    assert [c[:2] for c in _calls(parse(fam, text, TOOLS))] == [("get_time",
                                                                {"city": "New York"})]
    assert [c[:2] for c in _calls(parse(fam, two, TOOLS))] == [CALL, ("get_time", {})]


def test_optional_parameters_with_separators_take_any_subset_in_order(q4_1):
    """LFM2's keyword arguments with no required one: any of them, in order, a separator
    between two and none before the first."""
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                         "c": {"type": "integer"}}}}}]
    takes, close = _taker(q4_1)
    fam = _fam("lfm2")

    def call(args: str) -> str:
        return f"<|tool_call_start|>[pick({args})]<|tool_call_end|>"

    try:
        for ok in ("", "a=1", "b=2", "c=3", "a=1, c=3", "a=1, b=2, c=3", "b=2, c=3"):
            assert takes(tools, fam, call(ok)), ok
        for bad in (", b=2", "b=2, a=1", "a=1,, b=2", "a=1 b=2"):
            assert not takes(tools, fam, call(bad)), bad
    finally:
        close()


def test_tool_choice_auto_is_a_lazy_grammar_from_the_opener(q4_1):
    """auto: the text before a call is free; from the family's opener on, the call's
    grammar holds (llama.cpp's lazy grammar, triggered by the opener's token: an opener that
    is one token, as <tool_call> is for the models that write it; SmolLM2's <|im_start|>
    stands in for it here)."""

    from specli.backend import Grammar, Tokenizer, schemas_grammar

    fam = _fam("hermes")
    schemas, root, triggers = toolcall.grammar_parts(fam, TOOLS, required=False,
                                                     parallel=True)
    assert triggers == ["<tool_call>"]
    opener = "<|im_start|>"  # one token of SmolLM2's vocabulary
    gbnf = schemas_grammar(schemas, root.replace('"<tool_call>', f'"{opener}'), [opener])
    tok = Tokenizer(q4_1)

    def walk(text: str) -> bool:
        return _walk(tok, gbnf, text, special=True) is not None

    call = GRAMMAR_TEXT["hermes"].replace("<tool_call>", opener)
    try:
        assert walk("Anything at all, {\"name\": 1} [TOOL_CALLS] <tool_call> even")
        assert walk("Let me look.\n" + call)
        assert not walk(f"Let me look.\n{opener}\nnot a call")
        assert not walk(f'{opener}\n{{"name": "other_function", "arguments": {{}}}}')
        with pytest.raises(Exception, match="no token of this vocabulary"):
            Grammar(tok, schemas_grammar(schemas, root, triggers))  # <tool_call>: 5 tokens
    finally:
        tok.close()
    assert toolcall.grammar_parts(_fam("llama3"), TOOLS, False, True) is None  # no marker


@pytest.mark.parametrize("name", sorted(GRAMMAR_TEXT))
def test_a_call_cut_anywhere_by_the_token_limit_is_never_text(name):
    """A required call cut short at any character (finish_reason length): no part of it is
    content; once the tool's name is written whole (something follows it), it is the call
    as far as written, as llama-server gives it; before, no call. Whole and streamed."""
    fam, text = _fam(name), GRAMMAR_TEXT[name]
    named_at = text.index("special_function") + len("special_function")
    for i in range(1, len(text)):
        p = parse(fam, text[:i], TOOLS, cut=True)
        s = Splitter(fam, TOOLS)
        streamed = [s.feed(c) for c in text[:i]] + [s.finish(cut=True)]
        for got in (p, toolcall.Parsed("".join(d.content for d in streamed), "",
                                       tuple(c for d in streamed for c in d.calls))):
            assert got.content == "", (name, text[:i], got)
            assert [c.name for c in got.calls] == (["special_function"] if i > named_at
                                                    else []), (name, text[:i], got)
    whole = parse(fam, text, TOOLS, cut=True)  # a call that was whole is the whole call
    assert _calls(whole)[0][:2] == CALL


def test_text_before_a_cut_call_stays_and_a_cut_answer_without_a_call_is_all_text():
    fam = _fam("hermes")
    p = parse(fam, 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"ci',
              TOOLS, cut=True)
    assert p.content == "Let me look.\n"
    assert [(c.name, c.arguments) for c in p.calls] == [("get_time", '{"ci')]
    assert parse(fam, "Just text, cut in the mid", TOOLS, cut=True).content == \
        "Just text, cut in the mid"
    assert parse(fam, "Just text <tool", TOOLS, cut=True).content == "Just text "
    g = parse(GENERIC, '{"response": "Hello, wor', TOOLS, cut=True)
    assert g.content == "Hello, wor" and not g.calls


# -- test-chat.cpp's own cases for the tag families (issue 58, point 4) ---------------------

def _tool(name: str, props: dict, required: tuple = ()) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": props, "required": list(required)}}}


_INT, _STR = {"type": "integer"}, {"type": "string"}
CHAT_CPP_TOOLS = [
    _tool("special_function", {"arg1": _INT}, ("arg1",)),
    _tool("special_function_with_opt", {"arg1": _INT, "arg2": _INT}, ("arg1",)),
    _tool("empty_args", {}),
    _tool("python", {"code": _STR}, ("code",)),
    _tool("html", {"markup": _STR}, ("markup",)),
    _tool("get_time", {"city": _STR}, ("city",)),
    _tool("get_weather", {"city": _STR}, ("city",)),
    _tool("todo_list", {"todos": {"type": "array"}}, ("todos",)),
    _tool("edit", {"filename": _STR, "oldString": _STR, "newString": _STR},
          ("filename", "oldString", "newString")),
    _tool("set_config", {"config": {"type": "object"}}, ("config",)),
    _tool("Calendar.create_event", {"title": _STR, "participants": {
        "type": "array", "items": _STR}, "metadata": {"type": "object"}},
        ("title", "participants", "metadata")),
]
_SF, _OPT = ("special_function", {"arg1": 1}), ("special_function_with_opt",
                                                 {"arg1": 1, "arg2": 2})
# (family, what the model writes, the calls, content, reasoning, the prompt opened <think>)
CHAT_CPP = [
    ("qwen3-coder", "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n"
     "</parameter>\n</function>\n</tool_call>", [_SF], "", "", False),
    ("qwen3-coder", "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n"
     "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=special_function_with_opt>"
     "\n<parameter=arg1>\n1\n</parameter>\n<parameter=arg2>\n2\n</parameter>\n</function>\n"
     "</tool_call>", [_SF, _OPT], "", "", False),
    ("qwen3-coder", '<tool_call>\n<function=python>\n<parameter=code>\ndef hello():\n    print('
     '"Hello, world!")\n\nhello()\n</parameter>\n</function>\n</tool_call>',
     [("python", {"code": 'def hello():\n    print("Hello, world!")\n\nhello()'})], "", "",
     False),
    ("qwen3-coder", "<tool_call>\n<function=html>\n<parameter=markup>\n<html>\n <head>\n  "
     "<title>Hello!</title>\n </head>\n</html>\n</parameter>\n</function>\n</tool_call>",
     [("html", {"markup": "<html>\n <head>\n  <title>Hello!</title>\n </head>\n</html>"})],
     "", "", False),
    ("qwen3-coder", '<tool_call>\n<function=todo_list>\n<parameter=todos>\n[{"item": "Check '
     'stuff", "selected": false}, {"item": "Prepare stuff", "selected": true}]\n</parameter>\n'
     "</function>\n</tool_call>", [("todo_list", {"todos": [
         {"item": "Check stuff", "selected": False},
         {"item": "Prepare stuff", "selected": True}]})], "", "", False),
    ("qwen3-coder", "<tool_call>\n<function=edit>\n<parameter=newString>\n#include\n"
     "</parameter>\n<parameter=filename>\nfoo.c\n</parameter>\n<parameter=oldString>\n"
     "#iclunde\n</parameter>\n</function>\n</tool_call>", [("edit", {
         "newString": "#include", "filename": "foo.c", "oldString": "#iclunde"})], "", "",
     False),
    ("glm", "<tool_call>special_function\n<arg_key>arg1</arg_key>\n<arg_value>1</arg_value>\n"
     "</tool_call>", [_SF], "", "", False),
    ("glm", "<tool_call>special_function<arg_key>arg1</arg_key><arg_value>1</arg_value>"
     "</tool_call>", [_SF], "", "", False),
    ("glm", "I'm\nthinking</think><tool_call>special_function<arg_key>arg1</arg_key>"
     "<arg_value>1</arg_value></tool_call>", [_SF], "", "I'm\nthinking", True),
    ("glm", "<tool_call>special_function<arg_key>arg1</arg_key><arg_value>1</arg_value>"
     "</tool_call><tool_call>special_function_with_opt<arg_key>arg1</arg_key><arg_value>1"
     "</arg_value><arg_key>arg2</arg_key><arg_value>2</arg_value></tool_call>", [_SF, _OPT],
     "", "", False),
    ("minimax-m2", 'Let\'s call a tool:\n</think>\n\n<minimax:tool_call>\n<invoke name='
     '"empty_args">\n</invoke>\n</minimax:tool_call>', [("empty_args", {})], "",
     "Let's call a tool:", True),
    ("minimax-m2", '\n</think>\n\n<minimax:tool_call>\n<invoke name="special_function">\n'
     '<parameter name="arg1">1</parameter>\n</invoke>\n</minimax:tool_call>', [_SF], "", "",
     True),
    ("gemma4", '<|tool_call>call:get_time{city:<|"|>London<|"|>}<tool_call|>',
     [("get_time", {"city": "London"})], "", "", False),
    ("gemma4", "<|tool_call>call:empty_args{}<tool_call|>", [("empty_args", {})], "", "",
     False),
    ("gemma4", 'Hello, world!\nWhat\'s up?<|tool_call>call:get_time{city:<|"|>Paris<|"|>}'
     "<tool_call|>", [("get_time", {"city": "Paris"})], "Hello, world!\nWhat's up?", "",
     False),
    ("gemma4", '<|tool_call>call:get_time{city:<|"|>London<|"|>}<tool_call|><|tool_call>call:'
     'get_weather{city:<|"|>Paris<|"|>}<tool_call|>', [("get_time", {"city": "London"}),
                                                        ("get_weather", {"city": "Paris"})],
     "", "", False),
    ("gemma4", "<|tool_call>call:special_function{arg1:42}<tool_call|>",
     [("special_function", {"arg1": 42})], "", "", False),
    ("gemma4", '<|tool_call>call:todo_list{todos:[<|"|>buy milk<|"|>,<|"|>walk dog<|"|>]}'
     "<tool_call|>", [("todo_list", {"todos": ["buy milk", "walk dog"]})], "", "", False),
    ("gemma4", '<|tool_call>call:set_config{config:{theme:<|"|>dark<|"|>,count:3}}'
     "<tool_call|>", [("set_config", {"config": {"theme": "dark", "count": 3}})], "", "",
     False),
    ("lfm2", "<|tool_call_start|>[special_function(arg1=1)]<|tool_call_end|>", [_SF], "", "",
     False),
    ("lfm2", '<|tool_call_start|>[get_time(city="XYZCITY")]<|tool_call_end|>',
     [("get_time", {"city": "XYZCITY"})], "", "", False),
    ("lfm2", '<|tool_call_start|>[Calendar.create_event(title="demo", participants=["Alice", '
     '"Bob"], metadata={"priority": "high", "reminder": true})]<|tool_call_end|>',
     [("Calendar.create_event", {"title": "demo", "participants": ["Alice", "Bob"],
                                 "metadata": {"priority": "high", "reminder": True}})],
     "", "", False),
    ("lfm2", '<|tool_call_start|>[python(code="def hello():\\n    print(\'hey\')")]'
     "<|tool_call_end|>", [("python", {"code": "def hello():\n    print('hey')"})], "", "",
     False),
    ("lfm2", '<|tool_call_start|>[python(code="print(\\"hi\\")")]<|tool_call_end|>',
     [("python", {"code": 'print("hi")'})], "", "", False),
    ("lfm2", 'Let me check the time.<|tool_call_start|>[get_time(city="Paris")]'
     "<|tool_call_end|>", [("get_time", {"city": "Paris"})], "Let me check the time.", "",
     False),
    ("lfm2", "<|tool_call_start|>[special_function(arg1=1), special_function_with_opt(arg1=1, "
     "arg2=2)]<|tool_call_end|>", [_SF, _OPT], "", "", False),
    ("lfm2", '<think>I need to call a function</think>Let me check the time.'
     '<|tool_call_start|>[get_time(city="Paris")]<|tool_call_end|>',
     [("get_time", {"city": "Paris"})], "Let me check the time.", "I need to call a function",
     False),
]


@pytest.mark.parametrize("name,text,calls,content,reasoning,opened", CHAT_CPP)
def test_test_chat_cpps_tag_family_cases_read_back(name, text, calls, content, reasoning,
                                                    opened):
    """The answers llama.cpp's tests/test-chat.cpp parses for Qwen3-Coder, GLM 4.6/4.7,
    MiniMax-M2, Gemma 4 and LFM2, read as it reads them, whole and streamed."""
    fam = _fam(name)
    p = parse(fam, text, CHAT_CPP_TOOLS, forced_open=opened)
    assert (p.content.strip(), p.reasoning.strip()) == (content.strip(), reasoning.strip())
    assert [(n, a) for n, a, _ in _calls(p)] == calls
    s = Splitter(fam, CHAT_CPP_TOOLS, opened)
    streamed = [s.feed(c) for c in text] + [s.finish()]
    assert [(c.name, json.loads(c.arguments)) for d in streamed for c in d.calls] == calls


@pytest.mark.parametrize("name,text,calls", [
    (n, t, c) for n, t, c, content, reasoning, opened in CHAT_CPP
    if not content and not reasoning and not opened])
def test_test_chat_cpps_calls_are_what_a_required_grammar_takes(name, text, calls, q4_1):
    """test-chat.cpp checks each expected call against the family's grammar: a required
    call's grammar here takes each one too (parallel where there are several)."""
    takes, close = _taker(q4_1)
    try:
        assert takes(CHAT_CPP_TOOLS, _fam(name), text, parallel=len(calls) > 1)
    finally:
        close()


def test_the_llama3_reader_takes_the_blank_its_grammar_allows(q4_1):
    """Issue 60, point 2: Llama 3's required-call grammar (llama.cpp's JSON, a blank allowed
    after each brace) let the model write `{ "name": ...`, which the reader took for text:
    the call came back as content, finish stop. Both spellings are the grammar's and calls."""
    fam = _fam("llama3")
    takes, close = _taker(q4_1)
    try:
        for text in ('{"name": "special_function", "parameters": {"arg1": 1}}',
                     '{ "name": "special_function", "parameters": { "arg1": 1 } }'):
            assert takes(TOOLS, fam, text), text
            p = parse(fam, text, TOOLS)
            assert p.content == "" and _calls(p)[0][:2] == CALL, (text, p)
            s = Splitter(fam, TOOLS)
            got = [s.feed(c) for c in text] + [s.finish()]
            assert "".join(d.content for d in got) == ""
            assert [c.name for d in got for c in d.calls] == ["special_function"]
    finally:
        close()


def test_a_cut_answer_keeps_its_whole_calls_once_and_the_cut_one_last():
    """A review's cases: Functionary v3.2's call already whole when the limit came is read
    once, not twice; the generic answer's whole calls stay, in order, before the cut one."""
    f32 = _fam("functionary-v3.2")
    for text in ('special_function\n{"arg1": 1}', 'special_function\n{"arg1": 1}\n>>'):
        p = parse(f32, text, TOOLS, cut=True)
        assert [c.name for c in p.calls] == ["special_function"], (text, p)
    g = parse(GENERIC, '{"tool_calls": [{"name": "special_function", "arguments": {"arg1": 1}}'
              ', {"name": "get_time", "arguments": {"city": "Par', TOOLS, cut=True)
    assert [(c.name, c.arguments) for c in g.calls] == [
        ("special_function", '{"arg1": 1}'), ("get_time", '{"city": "Par')]


def test_a_tag_value_may_hold_any_tag_but_its_closers(q4_1):
    """A Qwen3-Coder string value holds a tag of its own (</title>), never the parameter's
    closing tag nor its call's (the reader would end the call there)."""
    fam = _fam("qwen3-coder")
    tools = [_tool("html", {"markup": _STR}, ("markup",))]
    call = "<tool_call>\n<function=html>\n<parameter=markup>\n{}\n</parameter>\n</function>\n" \
           "</tool_call>"
    takes, close = _taker(q4_1)
    try:
        assert takes(tools, fam, call.format("<b>x</b></title>"))
        assert not takes(tools, fam, call.format("a </function> b"))
        assert not takes(tools, fam, call.format("a </tool_call> b"))
        gemma = _fam("gemma4")
        nums = [_tool("set_config", {"config": {"type": "object"}}, ("config",))]
        assert takes(nums, gemma, "<|tool_call>call:set_config{config:{n:10,m:0}}<tool_call|>")
        assert not takes(nums, gemma, "<|tool_call>call:set_config{config:{n:01}}<tool_call|>")
    finally:
        close()


def _writer(q4_1):
    """write(tools, fam, parallel, seed): an answer a required call's grammar lets the model
    write, drawn at random token by token (the grammar's own characters favoured, so that
    strings and tags close), or None when a walk runs past its length; close() when done."""
    import numpy as np

    from specli.backend import Grammar, Tokenizer, schemas_grammar
    from specli.ggufmeta import read_header

    tok = Tokenizer(q4_1)
    eos = read_header(q4_1).kv["tokenizer.ggml.eos_token_id"]

    def pieces(chars) -> np.ndarray:
        return np.array(sorted({t for c in chars for t in tok.tokenize(
            c, add_special=False, parse_special=False)}), dtype=np.int32)

    closers = set(pieces('"}]>):\n '))

    def write(tools, fam, parallel: bool, seed: int) -> str | None:
        rng = np.random.default_rng(seed)
        schemas, root, _ = toolcall.grammar_parts(fam, tools, True, parallel)
        gbnf = schemas_grammar(schemas, root)
        g = Grammar(tok, gbnf)
        own = pieces(set(gbnf) | set("0123456789abc xyz"))
        out: list[int] = []
        for _ in range(600):
            if g.allowed(np.array([eos], dtype=np.int32))[0] and (rng.random() < 0.5 or
                                                                   len(out) > 100):
                return tok_text(out)
            cands = np.unique(np.concatenate([own, rng.integers(0, tok.n_vocab, 48,
                                                                dtype=np.int32)]))
            ok = cands[g.allowed(cands)]
            if not ok.size:  # what the grammar needs is none of these: look at them all
                every = np.arange(tok.n_vocab, dtype=np.int32)
                ok = every[g.allowed(every)]
                if not ok.size:
                    return None
            w = np.array([40.0 if t in closers else 1.0 for t in ok])
            t = int(rng.choice(ok, p=w / w.sum()))
            g.accept(t)
            out.append(t)
        return None

    def tok_text(ids) -> str:
        return b"".join(piece(t) for t in ids).decode("utf-8")

    def piece(t: int) -> bytes:
        import ctypes

        import llama_cpp as ll

        buf = ctypes.create_string_buffer(256)
        n = ll.llama_token_to_piece(tok.vocab, t, buf, 256, 0, False)
        return buf.raw[:n]

    return write, tok.close


@pytest.mark.parametrize("parallel", [False, True], ids=["one", "parallel"])
@pytest.mark.parametrize("name", [*sorted(TEMPLATE), "generic"])
def test_what_a_familys_call_grammar_writes_reads_back_as_its_calls(name, parallel, q4_1):
    """Issue 60, point 2: every family's reader takes everything its required-call grammar
    lets the model write (Llama 3's blank after a brace was one it did not): random answers
    drawn from the grammar itself, read whole and streamed, are calls of the tools, with
    JSON arguments, and no text."""
    fam = _fam(name)
    if toolcall.grammar_parts(fam, TOOLS, True, parallel) is None:
        pytest.skip(f"{name} has no call grammar")
    write, close = _writer(q4_1)
    names = {"special_function", "get_time"}
    try:
        written = [t for t in (write(TOOLS, fam, parallel, seed) for seed in range(12)) if t]
        assert len(written) >= 6, "the walks must end for this to test anything"
        for text in written:
            p = parse(fam, text, TOOLS)
            calls = _calls(p)
            assert calls and {n for n, _, _ in calls} <= names, (text, p)
            assert p.content.strip() == "", (text, p)
            assert all(isinstance(a, dict) for _, a, _ in calls), text
            s = Splitter(fam, TOOLS)
            got = [s.feed(c) for c in text] + [s.finish()]
            assert [(c.name, json.loads(c.arguments)) for d in got for c in d.calls] == \
                [(n, a) for n, a, _ in calls], text
    finally:
        close()


def test_a_json_strings_grammar_refuses_raw_control_characters(q4_1):
    """llama-cpp-python's schema converter let a JSON string hold a raw newline, so a
    constrained answer could be no JSON (found by the walk above: 12 families' calls came
    back as text). llama.cpp's own converter refuses control characters; so does specli's
    grammar now, for response_format and tool calls alike."""

    from specli.backend import Tokenizer, schema_grammar

    tok = Tokenizer(q4_1)
    try:
        gbnf = schema_grammar({"type": "object", "properties": {"a": {"type": "string"}},
                               "required": ["a"]})

        def takes(text: str) -> bool:
            return _walk(tok, gbnf, text) is not None

        assert takes('{"a": "x\\ny \\u00e9 é"}')  # escapes and any other character
        assert not takes('{"a": "x\ny"}') and not takes('{"a": "x\ty"}')
    finally:
        tok.close()
