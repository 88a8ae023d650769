"""One reading of a generation's events, every API's encoder over it (server/tools.reading,
server/formats.openai_events): the pieces a slot streams, read without a model."""

from __future__ import annotations

import asyncio
import json

from specli.server import formats as f
from specli.server.slots import Done, Piece
from specli.server.tools import ChatPlan, reading
from specli.stats import Stats
from specli.toolcall import ChatOptions


async def _events(items):
    for item in items:
        yield item


def _chunks(plan: ChatPlan | None, items, chat: bool = True) -> list[dict]:
    async def collect() -> list[str]:
        choice = f.chat_choice(plan.delta) if chat else f.text_choice
        return [line async for line in f.openai_events(
            reading(_events(items), plan), {"id": "x"}, choice, False)]

    return [json.loads(line[6:]) for line in asyncio.run(collect())]


def test_a_piece_with_no_text_sends_no_chunk():
    """A token that ends no character yet (the first bytes of a multi-byte one) comes as a
    piece with no text: no chunk with "content": "" (nor "text": ""), chat or completion."""
    items = [Piece("Hi", [], 0, [1]), Piece("", [], 0, [2]), Piece(" 🦙", [], 0, [3]),
             Done("stop", Stats(), "Hi 🦙", [], [1, 2, 3], "", 0)]
    plan = ChatPlan(ChatOptions((), {}, True))
    assert plan.plain
    chat = _chunks(plan, items)
    assert [c["choices"][0]["delta"] for c in chat] == [{"content": "Hi"}, {"content": " 🦙"},
                                                        {}]
    assert chat[-1]["choices"][0]["finish_reason"] == "stop"
    text = _chunks(None, items, chat=False)
    assert [c["choices"][0]["text"] for c in text] == ["Hi", " 🦙", ""]
