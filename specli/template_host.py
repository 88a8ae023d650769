"""Chat templates rendered in a process of their own, bounded in time and memory.

chat.py's sandbox bounds what a template builds and checks a deadline on every line the
template runs. Neither reaches inside one call into a built-in filter: `("ab" * 8000000) |
list | sort` sorts sixteen million strings in C (78 s and 3.2 GB here), where no trace runs
and no thread can be interrupted, and SIGTERM waited behind it. So a template renders in a
child process that holds nothing but Jinja: each render answers within its deadline (and a
second's grace) or the child is killed, and it lives under a memory limit (RLIMIT_AS). A
killed child takes nothing with it; the next render starts a fresh one. What a template
changes there, it changes in its own copy: the caller's messages cannot be touched.

`render_messages` (a conversation through a template: llama.cpp's own renderer for a
built-in one, else Jinja, there) and `caps` (what a template does with tools) are what
prompt.py and the commands call; chat.py is what runs in the child. A server sizes the
pool to its slots (`configure`), and `kill` ends a render at once when it stops. Requests
and answers are JSON: nothing a template makes is unpickled here.
"""

from __future__ import annotations

import atexit
import json
import secrets
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from specli import chat, child
from specli.child import Child, Pool, limit_memory, watch_parent
from specli.errors import BackendError, ContextOverflowError, UsageError

GRACE_S = 1.0  # past a render's own deadline (its trace stops Python sooner, with a reason)
MEMORY = 512 << 20  # bytes a child may take beyond what it holds once Jinja is in
WAIT_S = 10.0  # for a free renderer, before Busy (a 503)
HINT = "run without --chat and format the prompt yourself"


class Busy(child.Busy):
    """Every renderer stayed busy (with templates that run to their deadline): a 503."""


class TemplateHost:
    """One child process rendering templates, one call at a time (a lock holds a close or
    a restart off a render in flight)."""

    def __init__(self, memory: int = MEMORY):
        self.memory = memory
        self._child = Child("specli.template_host", [str(memory)], "chat template")
        self._lock = threading.Lock()
        self._killed = False  # kill(): a render in flight ends, and says why
        self.killed = 0  # children killed over a deadline or their memory (tests, logs)

    def start(self) -> None:
        with self._lock:
            self._child.start()

    def kill(self) -> None:
        """Kill the child now, a render in flight included (a server stopping)."""
        self._killed = True
        self._child.kill()

    def close(self) -> None:
        with self._lock:
            self._child.stop()

    def call(self, request: dict, seconds: float) -> dict:
        """One request and its answer within seconds + GRACE_S; over it the child is
        killed. UsageError where the child was stopped or died (its memory)."""
        try:
            payload = json.dumps(request).encode()
        except (ValueError, RecursionError):  # (a call's arguments nested ~1,000 deep)
            raise UsageError("the conversation nests too deeply to be rendered") from None
        with self._lock:
            self._killed = False
            c = self._child
            for attempt in range(2):  # a child that died while idle is started again
                c.wait_ready()
                try:
                    c.conn.send_bytes(payload)
                    break
                except OSError:
                    c.stop(kill=True)
                    if attempt:
                        raise BackendError("the chat template process takes no requests"
                                           ) from None
            try:
                ready = c.conn.poll(seconds + GRACE_S)
                reply = c.conn.recv_bytes() if ready else None
            except (OSError, EOFError):
                reply, ready = None, True
            if reply is None:
                how = c.stop(kill=not ready)
                self.killed += 1
                if self._killed:
                    raise UsageError("the chat template's render was stopped: the server is "
                                     "stopping")
                if not ready:
                    raise UsageError(f"the model's chat template was stopped: it ran for more "
                                     f"than {seconds:g} s", hint=HINT)
                raise UsageError(f"the model's chat template was stopped: it needed more than "
                                 f"{self.memory >> 20} MiB of memory ({how or 'it died'})",
                                 hint=HINT)
        return json.loads(reply)


class Renderers(Pool[TemplateHost]):
    """A few TemplateHosts: a render that runs to its deadline holds one, not every
    request's render behind it; a caller that finds none free within WAIT_S gets Busy."""

    def __init__(self, n: int = 1):
        super().__init__([TemplateHost() for _ in range(n)], lambda s: Busy(
            f"every chat template renderer stayed busy for {s:g} s", hint="try again"),
            WAIT_S)

    def prestart(self) -> None:
        """Start the children now, so that their imports overlap a model's load."""
        for h in self.hosts:
            h.start()

    def call(self, request: dict, seconds: float) -> dict:
        with self.one() as host:
            return host.call(request, seconds)


class Here:
    """Renders in this process, within the sandbox's own budget alone: for `specli audit`,
    whose audited run must start no process (--strict counts them)."""

    hosts: list = []

    def prestart(self) -> None:
        pass

    def call(self, request: dict, seconds: float) -> dict:
        return _dispatch(request, MEMORY)

    def kill(self) -> None:
        pass

    def close(self) -> None:
        pass


_pool: Renderers | Here | None = None
_lock = threading.Lock()


def pool() -> Renderers | Here:
    """This process's renderers: one child, unless configure() said otherwise."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = Renderers(1)
        return _pool


def configure(n: int) -> Renderers | Here:
    """n renderers from now on (a server's: as many as its grammar checkers); 0: render in
    this process (an audited run)."""
    global _pool
    with _lock:
        old, _pool = _pool, Renderers(n) if n else Here()
    if old is not None:
        old.close()  # (after a render in flight on it)
    return _pool


@atexit.register
def _close() -> None:
    if _pool is not None:
        _pool.close()


def render_chat(template: str | None, user: str, bos: str = "", eos: str = "",
                system: str | None = None) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}]
    return render_messages(template, messages, bos, eos)


# a template rendered by llama.cpp itself: (messages, add_generation_prompt) -> text
Builtin = Callable[[list[dict], bool], str]


def render_messages(template: str | None, messages: list[dict], bos: str = "",
                    eos: str = "", *, seconds: float | None = None,
                    max_bytes: int | None = None, continue_final: bool = False,
                    builtin: Builtin | None = None, context: dict | None = None,
                    add_generation_prompt: bool = True) -> str:
    """A conversation through the model's template (ChatML when it has none), ready for the
    assistant's reply; with continue_final, ready to continue the final (assistant) message
    where its text ends (a prefill), whatever the template puts after a turn. A template
    that fails, runs past `seconds` or builds anything larger than RENDER_BYTES is a
    UsageError; output past `max_bytes` (what the context can hold) is a
    ContextOverflowError. builtin: render with llama.cpp's own renderer instead of Jinja.
    context: the template's other variables (tools, template_context())."""
    def render(msgs: list[dict], add_generation_prompt: bool = add_generation_prompt) -> str:
        if builtin is None:
            return _render(template, msgs, bos, eos, seconds, max_bytes,
                           add_generation_prompt, context)
        text = builtin(msgs, add_generation_prompt)
        if max_bytes is not None and len(text) > max_bytes:
            raise ContextOverflowError(
                f"the conversation renders to more than {max_bytes} characters, more than "
                "the context can hold", hint="shorten the conversation or raise -c/--ctx-size")
        return text

    if continue_final:
        # render the last turn with a marker for its text, and cut where the marker is (no
        # NUL in it: llama.cpp's renderers take C strings)
        marker = f"\ue000specli-prefill-{secrets.token_hex(8)}\ue000"
        last, marked = _marked(messages[-1].get("content"), marker)
        text = render([*messages[:-1], {**messages[-1], "content": marked}],
                      add_generation_prompt=False)
        at = text.find(marker)
        if at < 0:
            raise UsageError("the chat template drops the final assistant message: it cannot "
                             "be continued", hint="end the conversation with a user message")
        return text[:at] + last
    return render(messages)


def _marked(content, marker: str) -> tuple[str, str | list]:
    """A final message's text to continue, and its content with the marker where that text
    stands: the content itself, or its last text block (a template that reads blocks, with
    the turn's reasoning before them)."""
    if not isinstance(content, list):
        return str(content or ""), marker
    at = max((i for i, b in enumerate(content) if isinstance(b, dict) and
              b.get("type") == "text"), default=None)
    if at is None:
        return "", [*content, {"type": "text", "text": marker}]
    return str(content[at].get("text") or ""), [
        *content[:at], {**content[at], "text": marker}, *content[at + 1:]]


def _render(template: str | None, messages: list[dict], bos: str, eos: str,
            seconds: float | None, max_bytes: int | None,
            add_generation_prompt: bool = True, context: dict | None = None) -> str:
    """A Jinja render in a child process: chat.render_here there."""
    seconds = chat.RENDER_SECONDS if seconds is None else seconds
    out = pool().call({"op": "render", "template": template, "messages": messages,
                       "bos": bos, "eos": eos, "seconds": seconds, "max_bytes": max_bytes,
                       "limit": chat.RENDER_BYTES,
                       "add_generation_prompt": add_generation_prompt,
                       "context": context}, seconds)
    return _answer(out)


def caps(template: str | None, seconds: float) -> tuple[bool, bool, bool]:
    """chat.caps_here(template): what a template does with a system message and with tool
    calls, probed in a child process."""
    return tuple(_answer(pool().call({"op": "caps", "template": template,
                                      "seconds": seconds}, 3 * seconds)))


def _answer(out: dict):
    if "error" not in out:
        return out["value"]
    if out["error"] == "overflow":
        raise ContextOverflowError(out["message"], hint=out.get("hint"))
    raise UsageError(out["message"], hint=out.get("hint"))


# -- the child ---------------------------------------------------------------------------------

def _dispatch(req: dict, memory: int) -> dict:
    """One request, answered: {"value": ...} or {"error": usage|overflow, "message", "hint"}."""
    try:
        if req["op"] == "caps":
            value = chat.caps_here(req["template"], req["seconds"])
        else:
            value = chat.render_here(
                req["template"], req["messages"], req["bos"], req["eos"], req["seconds"],
                req["max_bytes"], req["limit"], req["add_generation_prompt"], req["context"])
        return {"value": value}
    except ContextOverflowError as e:
        return {"error": "overflow", "message": e.message, "hint": e.hint}
    except UsageError as e:
        return {"error": "usage", "message": e.message, "hint": e.hint}
    except MemoryError:
        return {"error": "usage", "message": "the model's chat template was stopped: it "
                f"needed more than {memory >> 20} MiB of memory", "hint": HINT}


def _serve(fd: int, memory: int) -> None:
    watch_parent()
    conn = Connection(fd)
    limit_memory(memory)
    conn.send_bytes(b"ready")
    while True:
        try:
            req = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        conn.send_bytes(json.dumps(_dispatch(req, memory)).encode())


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
