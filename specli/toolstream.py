"""A streamed answer read as it comes: `Splitter.feed` hands back, for each piece, the new
reasoning, the new content and the calls completed since (OpenAI's deltas).

The reader keeps its place instead of reading the whole answer again at every piece (which
made a stream's reading quadratic in its length): how far the reasoning and the content were
sent, where the reasoning ended, where the call region began, how far the markers were looked
for. Text is looked at again only within a marker's length of where the last look ended. A
call region, an unfinished JSON answer and the answers of the families read whole
(Functionary v3.2, and GPT-OSS with reasoning_format none) are read again whole only while
they are short (SMALL) and, beyond, each time they have grown by an eighth: a call is
complete when its closer comes, and the last reading (`finish`) is whole, so nothing is lost
and the total stays linear. Each delta is a part of the finished answer's reading
(toolcall.parse), sent once and never taken back, so the deltas add up to it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from specli.toolcall import (
    HARMONY_END,
    Family,
    Parsed,
    ToolCall,
    harmony,
    named,
    parse,
    read_generic,
)
from specli.tooljson import STRING_BODY, args_text, held, json_at, utf8_safe

SMALL = 2048  # characters of a region read again whole at every piece


def _due(size: int, last: int) -> bool:
    """Whether a region of `size` characters, last read whole at `last`, is read again."""
    return last < 0 or size < SMALL or size - last >= size >> 3


_NONBLANK = re.compile(r"\S")
_RESPONSE = re.compile(r'\{\s*"response"\s*:\s*"')
_MESSAGE = "<|message|>"
_TO = re.compile(r"to=functions\.([\w.-]+)")


def _grown(old: str, new: str) -> str:
    # what was sent is never taken back; a reading that is not an extension adds nothing
    return new[len(old):] if new.startswith(old) else ""


@dataclass
class Splitter:
    fam: Family
    tools: Sequence[dict] = ()
    forced_open: bool = False
    reasoning_format: str = "deepseek"
    parse_calls: bool = True
    ids: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        f = self.fam
        self.text = ""  # the answer so far
        self._content: list[str] = []  # what was sent
        self._reasoning: list[str] = []
        self._calls: tuple[ToolCall, ...] = ()
        self._last = -1  # size of the region (or answer) at its last whole reading
        if f.parse_all is harmony and self.reasoning_format != "none":
            self._stage = "harmony"
            self._h = _Harmony()
        elif f.parse_all is not None:
            self._stage = "whole"
        elif self.reasoning_format != "none" and f.think is not None:
            self._stage = "think" if self.forced_open else "lead"
        else:
            self._stage = "rest"
        # the think stage: where the reasoning's body starts, how far it was sent, looked at
        self._body = self._r_sent = self._scan = 0
        self._blank = 0  # text before this is blank (the lead's, or a generic answer's)
        # the rest: the answer after its reasoning (parse's `rest`), from here in the text;
        # with reasoning_format none, an opening marker the prompt wrote goes first
        self._prefix = (f.think[0] if self.reasoning_format == "none" and self.forced_open
                        and f.think and f.parse_all is None else "")
        self._done = 0  # how much of the text was sent as content
        self._rscan = 0  # the text before this holds no opener
        self._at = -1  # where the call region starts in the text
        self._json = ""  # the generic family: "", "text", "json", "done"
        self._lead = 0  # where its JSON answer starts
        self._str = -1  # where its response string's unread part starts (-1: none yet)

    @property
    def sent(self) -> Parsed:
        return Parsed("".join(self._content), "".join(self._reasoning), self._calls)

    def finish(self, cut: bool = False) -> Parsed:
        """The rest of the reading, once the answer is whole (cut: by the token limit, so
        a call left open is given as far as it was written, toolcall.cut_call)."""
        return self._final(cut)

    def feed(self, piece: str) -> Parsed:
        t, self.text = self.text, ""
        t += piece  # grown in place: the only reference is this name
        self.text = t
        if self._stage == "harmony":
            content, reasoning = self._h.read(self.text)
            return self._send(content, reasoning, self._new_calls(self._h.calls))
        if self._stage == "whole":
            return self._whole()
        reasoning = ""
        if self._stage == "lead" and not self._decide():
            return Parsed("")
        if self._stage == "think":
            reasoning = self._think()
            if self._stage == "think":
                return self._send("", reasoning)
        content, calls = self._more()
        return self._send(content, reasoning, calls)

    # -- the reasoning --------------------------------------------------------------------

    def _decide(self) -> bool:
        """Whether the answer opens with the reasoning's marker (the think stage) or not (all
        of it is rest), once it is known."""
        start, text = self.fam.think[0], self.text
        m = _NONBLANK.search(text, self._blank)
        if m is None:
            self._blank = len(text)
            return False
        lead = m.start()
        self._blank = lead
        if text.startswith(start, lead):
            self._stage, self._body = "think", lead + len(start)
            self._r_sent = self._scan = self._body
            return True
        if start.startswith(text[lead:lead + len(start)]) and len(text) - lead < len(start):
            return False
        self._stage = "rest"
        return True

    def _think(self) -> str:
        """The new reasoning; the rest stage once the reasoning is closed."""
        end, text = self.fam.think[1], self.text
        at = text.find(end, self._scan)
        if at < 0:
            self._scan = max(self._body, len(text) - len(end) + 1)
            out = held(text[self._r_sent:], (end,))
            self._r_sent += len(out)
            return out
        out = text[self._r_sent:at]
        self._r_sent = at
        self._stage = "rest"
        self._done = self._rscan = at + len(end)
        return out

    # -- the rest: content, then the call region -----------------------------------------------

    def _more(self) -> tuple[str, tuple[ToolCall, ...]]:
        r, fam = self.text, self.fam
        if fam.name == "generic":
            return self._generic()
        content = ""
        if self._at < 0:
            openers = fam.openers if self.parse_calls else ()
            at = min((i for i in (r.find(o, self._rscan) for o in openers) if i >= 0),
                     default=-1)
            if at < 0:
                if openers:
                    self._rscan = max(self._rscan, len(r) - max(map(len, openers)) + 1)
                piece = held(r[self._done:], (*openers, *(fam.content_wrap or ())))
            else:
                piece, self._at = r[self._done:at], at
            self._done += len(piece)
            if fam.content_wrap is not None:
                piece = piece.replace(fam.content_wrap[0], "").replace(fam.content_wrap[1], "")
            content, self._prefix = self._prefix + piece, ""
        calls: tuple[ToolCall, ...] = ()
        if self._at >= 0 and _due(len(r) - self._at, self._last):
            self._last = len(r) - self._at
            found = fam.calls(r[self._at:], self.tools)
            if not any(a is None for _, a, _ in found):
                calls = self._new_calls([ToolCall(n, a, i or "") for n, a, i in found])
        return content, calls

    def _generic(self) -> tuple[str, tuple[ToolCall, ...]]:
        """The generic family's answer: text, or one JSON object ({"response": "..."} streams
        its response as it is written; {"tool_calls": [...]} is read once complete)."""
        r = self.text  # (the generic family has no reasoning: its rest is the answer)
        if not self._json:
            if not self.parse_calls:
                self._json = "text"
            else:
                m = _NONBLANK.search(r, self._blank)
                if m is None:
                    self._blank = len(r)
                    return "", ()
                self._lead = m.start()
                self._json = "json" if r[self._lead] == "{" else "text"
        if self._json == "text":
            out, self._done = r[self._done:], len(r)
            return out, ()
        if self._json != "json":
            return "", ()
        size = len(r) - self._lead
        if _due(size, self._last):
            self._last = size
            if json_at(r, self._lead) is not None:  # complete: its reading is final
                self._json = "done"
                p = read_generic(r, False)
                return (_grown("".join(self._content), p.content),
                        self._new_calls(list(p.calls)))
            if self._str < 0 and (m := _RESPONSE.match(r, self._lead)):
                self._str = m.end()
        if self._str < 0:
            return "", ()
        end = STRING_BODY.match(r, self._str).end()
        try:
            out = json.loads('"' + r[self._str:end] + '"')
        except ValueError:  # an escape JSON has not: nothing more streams (finish reads it)
            self._str, self._json = -1, "done"
            return "", ()
        if out and "\ud800" <= out[-1] <= "\udbff":  # a pair's first half: its second may come
            out, end = out[:-1], end - 6
        self._str = end
        return utf8_safe(out), ()

    # -- whole readings -------------------------------------------------------------------

    def _whole(self) -> Parsed:
        if not _due(len(self.text), self._last):
            return Parsed("")
        self._last = len(self.text)
        now = parse(self.fam, self.text, self.tools, forced_open=self.forced_open,
                    reasoning_format=self.reasoning_format, parse_calls=self.parse_calls,
                    final=False, ids=self.ids)
        return self._against(now)

    def _final(self, cut: bool) -> Parsed:
        now = parse(self.fam, self.text, self.tools, forced_open=self.forced_open,
                    reasoning_format=self.reasoning_format, parse_calls=self.parse_calls,
                    final=True, ids=self.ids, cut=cut)
        return self._against(now)

    def _against(self, now: Parsed) -> Parsed:
        old = self.sent
        return self._send(_grown(old.content, now.content), _grown(old.reasoning, now.reasoning),
                          now.calls[len(old.calls):])

    # -- what is sent ---------------------------------------------------------------------

    def _new_calls(self, calls: list[ToolCall]) -> tuple[ToolCall, ...]:
        """The calls of a reading (all of them, in order) beyond those sent, with their ids."""
        if not self.parse_calls:
            return ()
        return named(Parsed("", "", tuple(calls)), self.ids, self.fam).calls[len(self._calls):]

    def _send(self, content: str = "", reasoning: str = "", calls=()) -> Parsed:
        if content:
            self._content.append(content)
        if reasoning:
            self._reasoning.append(reasoning)
        calls = tuple(calls)
        self._calls += calls
        return Parsed(content, reasoning, calls)


class _Harmony:
    """GPT-OSS's messages read as they come (toolcall.harmony's reading, kept in place): a
    message's header up to <|message|>, its body up to an end marker; reasoning and content
    stream as written, a call is read when its message ends."""

    def __init__(self) -> None:
        self.pos = 0  # where the current message's header starts
        self.start = -1  # where its body starts (-1: header still being written)
        self.scan = 0  # the text before this holds no marker looked for
        self.sent = 0  # how far the current body (or the markerless answer) was sent
        self.channel = ""  # "call", "reasoning", "content"
        self.to = ""
        self.any = False  # a <|message|> was seen
        self.calls: list[ToolCall] = []
        self.lt = -1  # the last "<|" of the body, and whether a "|>" closes it
        self.closed = True
        self.lscan = 0  # the body before this was looked at for them
        self.blank = 0

    def read(self, text: str) -> tuple[str, str]:
        """The new content and reasoning; the calls read so far are in `calls`."""
        content, reasoning = [], []
        while True:
            if self.start < 0:
                at = text.find(_MESSAGE, self.scan)
                if at < 0:
                    self.scan = max(self.pos, len(text) - len(_MESSAGE) + 1)
                    if not self.any:  # no channel written yet: the text itself
                        content.append(self._markerless(text))
                    break
                header = text[self.pos:at]
                self.start = self.sent = self.scan = at + len(_MESSAGE)
                self.lt, self.closed, self.lscan = -1, True, self.start
                to = _TO.search(header)
                self.channel, self.to = ("call", to.group(1)) if to else \
                    ("reasoning", "") if "analysis" in header else ("content", "")
                self.any = True
            end = HARMONY_END.search(text, self.scan)
            if end is None:
                self.scan = max(self.start, len(text) - 10)  # the longest end marker, less 1
                if self.channel != "call":
                    out = self._unmarked(text, self.start)
                    (reasoning if self.channel == "reasoning" else content).append(out)
                break
            body = text[self.start:end.start()]
            if self.channel == "call":
                got = json_at(body, 0)
                args = args_text(got[0]) if got and not body[got[1]:].strip() else None
                if args is not None:
                    self.calls.append(ToolCall(self.to, args, ""))
                else:
                    content.append(body)
            else:
                (reasoning if self.channel == "reasoning" else content).append(
                    text[self.sent:end.start()])
            self.pos = self.scan = end.start()
            self.start = -1
        return "".join(content), "".join(reasoning)

    def _unmarked(self, text: str, start: int) -> str:
        """The body's new text up to a special token still being written (toolcall.unmarked,
        kept in place: the last "<|" holds what follows it until a "|>" comes)."""
        i, found = max(start, self.lscan), False
        while (j := text.find("<|", i)) >= 0:
            self.lt, i, found = j, j + 2, True
        if found:
            self.closed = False
        if not self.closed and text.find("|>", max(self.lt + 2, self.lscan)) >= 0:
            self.closed = True
        self.lscan = max(start, len(text) - 1)
        out = text[self.sent:self.lt] if not self.closed else held(text[self.sent:], ("<|",))
        self.sent += len(out)
        return out

    def _markerless(self, text: str) -> str:
        m = _NONBLANK.search(text, self.blank)
        if m is None:
            self.blank = len(text)
            return ""
        self.blank = m.start()
        if text.startswith("<|", m.start()) or len(text) - m.start() < 2 and \
                text[m.start():] == "<":
            return ""
        return self._unmarked(text, 0)
