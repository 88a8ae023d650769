"""llama.cpp's built-in chat templates: its C++ renderers, no Jinja."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

from specli.backend._lib import ll
from specli.errors import BackendError, UsageError


@functools.cache
def builtin_templates() -> tuple[str, ...]:
    """The names llama.cpp renders in C++ (llama_chat_builtin_templates): chatml, llama3..."""
    n = ll.llama_chat_builtin_templates((ctypes.c_char_p * 0)(), 0)
    names = (ctypes.c_char_p * n)()
    ll.llama_chat_builtin_templates(names, n)
    return tuple(x.decode() for x in names)


@functools.lru_cache(maxsize=16)
def knows_template(template: str) -> bool:
    """Whether llama.cpp renders this template itself (a built-in name, or a template it
    recognises by its text)."""
    try:
        apply_builtin_template(template, [{"role": "user", "content": "test"}])
    except UsageError:
        return False
    return True


def apply_builtin_template(template: str, messages: Sequence[dict],
                           add_generation_prompt: bool = True) -> str:
    """A conversation through llama_chat_apply_template: a built-in name, or a template
    llama.cpp recognises by its text (llama-server's route without --jinja). UsageError for
    one it does not know, and for text it cannot pass (a NUL would end a C string early)."""
    texts = [(str(m.get("role", "")), str(m.get("content") or "")) for m in messages]
    if any("\x00" in r or "\x00" in c for r, c in texts) or "\x00" in template:
        raise UsageError("a message holds a NUL character, which llama.cpp's built-in chat "
                         "templates cannot pass", hint="remove it, or use a Jinja template")
    enc = [(r.encode(), c.encode()) for r, c in texts]  # kept alive while C reads them
    chat = (ll.llama_chat_message * max(len(enc), 1))(
        *[ll.llama_chat_message(r, c) for r, c in enc])
    size = 2 * sum(len(r) + len(c) for r, c in enc) + 256
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = ll.llama_chat_apply_template(template.encode(), chat, len(enc),
                                         add_generation_prompt, buf, size)
        if n < 0:
            raise UsageError("llama.cpp does not know this chat template",
                             hint="name a built-in one (" + ", ".join(builtin_templates()[:6])
                             + "...) or pass Jinja with --jinja")
        if n <= size:
            return buf.raw[:n].decode("utf-8", "replace")
        size = n  # the buffer was too small: n is what it needs
    raise BackendError("llama_chat_apply_template kept asking for more room")
