"""Chat templates render as llama.cpp renders them: tools, assistant tool calls, tool results,
reasoning history, enable_thinking and the date, for the templates of llama.cpp's
models/templates/ whose families specli reads tool calls of. The expected prompts are native
llama-server's /apply-template answers, recorded by scripts/record_templates.py (with the
template files, tests/data/templates/); the date they printed becomes today's."""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path

import pytest

from specli import prompt
from specli.chat import template_context
from specli.config import ModelParams
from specli.errors import UsageError
from specli.server.routes import _conversation
from specli.server.schemas import ChatRequest
from specli.server.tools import plan

DATA = Path(__file__).parent / "data" / "templates"
NATIVE = json.loads((DATA / "native.json").read_text())


class Target:
    """What rendering reads of a target: its template, its special tokens' text (SmolLM2's,
    the model the prompts were recorded with), its context."""

    def __init__(self, template: str, bos: str, eos: str):
        self.template, self.bos, self.eos = template, bos, eos
        self.params = ModelParams(path="smollm2.gguf", jinja=True)
        self.n_ctx, self.max_token_bytes = 8192, 16

    def chat_template(self) -> str:
        return self.template

    def special_text(self, which: str) -> str:
        return self.bos if which == "bos" else self.eos


@pytest.fixture(scope="module")
def specials(q4_1) -> tuple[str, str]:
    from specli.ggufmeta import read_header

    h = read_header(q4_1, arrays=["tokenizer.ggml.tokens"])
    tokens = h.kv["tokenizer.ggml.tokens"]
    return tokens[h.kv["tokenizer.ggml.bos_token_id"]], tokens[h.kv["tokenizer.ggml.eos_token_id"]]


def render(name: str, body: dict, specials: tuple[str, str]) -> str:
    from specli.toolcall import ChatOptions  # noqa: F401 - the plan's options

    source = (DATA / f"{name}.jinja").read_text()
    req = ChatRequest.model_validate(body)
    target = Target(source, *specials)
    _, renders, _ = prompt.template_caps(source)
    cp = plan(req, source, renders)
    return prompt.render_messages(target, _conversation(req)[0], False, cp.opts)


# the forms of the date the templates print: the context's two and every strftime_now format
# in the template files (Apertus and Solar print the ISO date)
FORMATS = {"%d %b %Y", "%b %d %Y"} | {
    m[1] for f in DATA.glob("*.jinja")
    for m in re.finditer(r"strftime_now\(['\"]([^'\"]*)['\"]\)", f.read_text())}


def today(text: str) -> str:
    """The recorded text with the recording's date, in each form, as today's."""
    recorded = datetime.strptime(NATIVE["date_string"], "%d %b %Y")
    now = datetime.now()
    for fmt in sorted(FORMATS):
        text = text.replace(recorded.strftime(fmt), now.strftime(fmt))
    return text


# where specli renders otherwise, and why: (what specli writes, what native writes there,
# at the last place specli writes it)
DELIBERATION = ("Deliberation: enabled", "Deliberation: disabled")
KNOWN = {
    # llama.cpp hands this family's assistant turns to the template as content blocks
    # ([{type: thinking}, {type: text}]), which Devstral's template does not read: the
    # assistant's text is dropped from the history. specli keeps it.
    ("unsloth-mistral-Devstral-Small-2507", "reasoning_history"): ("Hello!", ""),
    # add_generation_prompt false: llama.cpp leaves the variable undefined (it sets it only
    # when true), and these templates take an undefined one as true: native opens the
    # assistant's turn all the same. specli passes false, and the template does not.
    ("llama-cpp-rwkv-world", "no_generation_prompt"): ("\n\n", "\n\nAssistant: <think>"),
    ("upstage-Solar-Open-100B", "no_generation_prompt"): ("<|end|>", "<|end|><|begin|>assistant"),
    # --reasoning auto: llama.cpp turns thinking on where its parser finds the template's
    # reasoning markers, and finds none in Apertus's; specli leaves enable_thinking on, as
    # for every template (the model deliberates; --reasoning off or reasoning_effort none
    # turn it off)
    **{("Apertus-8B-Instruct", c): DELIBERATION for c in (
        "plain", "no_generation_prompt", "tools", "round_trip", "reasoning_history")},
}
# what specli refuses (a 400 naming the template) and native renders: Command R+'s tool-use
# template wants Cohere's own tool format (parameter_definitions with Python type names),
# which llama.cpp builds from the tools; specli hands every template OpenAI's tools
REFUSED = {("CohereForAI-c4ai-command-r-plus-tool_use", c) for c in ("tools", "round_trip")}


@functools.cache  # once per template and worker, when its first case runs (~50 ms a compile)
def generic(name: str) -> bool:
    """A template that renders no tool calls: specli gives it the generic format."""
    return not prompt.template_caps((DATA / f"{name}.jinja").read_text())[1]


CASES = [(t, c) for t, convs in NATIVE["renders"].items() for c in convs]


@pytest.mark.parametrize("name,conv", CASES)
def test_a_template_renders_as_llama_server_renders_it(name, conv, specials):
    """Every recorded conversation renders as native llama-server rendered it, but for the
    known differences (KNOWN: the text specli keeps) and the tools of a template that renders
    no tool calls: specli gives it the generic format, the tools described in the system
    prompt (or the first message, where the template has no system role), earlier calls and
    results as the JSON the model answers in (which Gemma 2's alternating roles take, where
    native refuses a tool turn)."""
    want = NATIVE["renders"][name][conv]
    body = NATIVE["conversations"][conv]
    if generic(name) and conv == "round_trip":
        trip = render(name, body, specials)
        assert '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}' in trip
        assert '{"tool_response": {"tool": "get_weather", "content": "Sunny, 21 C"}}' in trip
        return
    if generic(name) and body.get("tools"):
        tools = render(name, body, specials)
        assert "You can call any of the following tools" in tools and '"get_weather"' in tools
        body = {k: v for k, v in body.items() if k != "tools"}  # the rest as native's
    if want["status"] != 200:
        with pytest.raises(UsageError):
            render(name, body, specials)
        return
    if (name, conv) in REFUSED:
        with pytest.raises(UsageError, match="template failed"):
            render(name, body, specials)
        return
    got = render(name, body, specials)
    if (name, conv) in KNOWN:
        ours, theirs = KNOWN[(name, conv)]  # at the last place specli writes it
        assert ours in got and (not theirs or theirs not in got)
        got = theirs.join(got.rsplit(ours, 1))
    assert got == today(want["prompt"])


def test_the_date_is_todays():
    assert template_context()["date_string"] == datetime.now().strftime("%d %b %Y")


def test_earlier_reasoning_is_kept_unless_preserve_reasoning_is_off(specials):
    """llama.cpp's --reasoning-preserve (on by default): templates that can drop earlier
    turns' reasoning keep it; preserve_reasoning false (--no-reasoning-preserve, or a
    request's chat_template_kwargs) drops it."""
    from specli.cli.serve import _reasoning

    history = NATIVE["conversations"]["reasoning_history"]
    off = {**history, "chat_template_kwargs": {"preserve_reasoning": False}}
    for name in ("GLM-4.7-Flash", "deepseek-ai-DeepSeek-V4", "LFM2.5-8B-A1B"):
        assert "A greeting." in render(name, history, specials)
        assert "A greeting." not in render(name, off, specials)
    assert "preserve_reasoning" not in _reasoning("auto", "auto", None)["template_kwargs"]
    assert _reasoning("auto", "auto", None, False)["template_kwargs"] == {
        "preserve_reasoning": False}
    assert _reasoning("auto", "auto", '{"preserve_reasoning": true}', False)[
        "template_kwargs"]["preserve_reasoning"] is True  # the JSON's own value wins
