"""How answers are written: usage, llama-server's timings, and server-sent event streams (one
chunker for OpenAI's chat and completion streams, one for llama-server's /completion)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from fastapi.responses import Response, StreamingResponse

from specli.errors import BackendError, SpecliError
from specli.server.slots import Done, Generation, Piece
from specli.stats import Stats


def finish(done: Done) -> str:
    return "length" if done.finish_reason == "length" else "stop"


def cached(s: Stats) -> int:
    """Prompt tokens taken from the slot's cache, not evaluated (llama-server's cache_n)."""
    return max(s.n_prompt - (s.target.prompt_n + 1), 0) if s.n_prompt else 0


def usage(s: Stats) -> dict:
    return {"prompt_tokens": s.n_prompt, "completion_tokens": s.n_predict,
            "total_tokens": s.n_prompt + s.n_predict,
            "prompt_tokens_details": {"cached_tokens": cached(s)},
            "speculative": {"drafts": s.n_steps, "draft_n": s.n_drafted,
                            "draft_n_accepted": s.n_accept,
                            "accept_rate": round(s.accept_rate, 4)}}


def timings(s: Stats) -> dict:
    """llama-server's timings object, with the draft figures always present."""
    prompt_n = s.target.prompt_n + 1 if s.n_prompt else 0  # the last prompt token opens step 1
    prompt_ms, predicted_ms = 1e3 * s.t_encode_s, 1e3 * s.t_decode_s

    def per(n: float, ms: float) -> tuple[float, float]:
        return (ms / n if n else 0.0), (1e3 * n / ms if ms else 0.0)

    p_tok, p_sec = per(prompt_n, prompt_ms)
    g_tok, g_sec = per(s.n_predict, predicted_ms)
    return {"cache_n": cached(s),
            "prompt_n": prompt_n, "prompt_ms": prompt_ms, "prompt_per_token_ms": p_tok,
            "prompt_per_second": p_sec, "predicted_n": s.n_predict,
            "predicted_ms": predicted_ms, "predicted_per_token_ms": g_tok,
            "predicted_per_second": g_sec, "draft_n": s.n_drafted,
            "draft_n_accepted": s.n_accept, "draft_accept_rate": s.accept_rate,
            "draft_accepted_per_position": s.accept_rate_per_pos}


def data(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def sse(events: AsyncIterator[str], gen: Generation, done_marker: bool = True) -> Response:
    async def body() -> AsyncIterator[str]:
        try:
            async for line in events:
                yield line
            if done_marker:
                yield "data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - the status line is sent: say it in the stream
            kind = "invalid_request_error" if isinstance(e, SpecliError) and not isinstance(
                e, BackendError) else "server_error"
            yield data({"error": {"message": getattr(e, "message", None) or str(e),
                                  "type": kind, "param": None, "code": None}})
        finally:
            gen.cancel()  # a client that went away frees its slot at the next token

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# choice(text, finish_reason) -> one choice of a chunk: chat's delta or completion's text
Choice = Callable[[str | None, str | None], dict]


def chat_choice(text: str | None, finish_reason: str | None) -> dict:
    delta = {} if text is None else {"content": text}
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def text_choice(text: str | None, finish_reason: str | None) -> dict:
    return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}


async def openai_events(gen: Generation, head: dict, choice: Choice, with_usage: bool,
                        first: dict | None = None) -> AsyncIterator[str]:
    """An OpenAI stream: an optional first chunk, one chunk per piece, the finish reason,
    then (stream_options.include_usage) a chunk with no choices and the usage."""
    if first is not None:
        yield data({**head, "choices": [first]})
    async for ev in gen.events():
        if isinstance(ev, Piece):
            yield data({**head, "choices": [choice(ev.text, None)]})
        else:
            yield data({**head, "choices": [choice(None, finish(ev))]})
            if with_usage:
                yield data({**head, "choices": [], "usage": usage(ev.stats),
                            "timings": timings(ev.stats)})


async def llama_events(gen: Generation, model: str) -> AsyncIterator[str]:
    async for ev in gen.events():
        if isinstance(ev, Piece):
            yield data({"content": ev.text, "stop": False, "id_slot": gen.slot.id})
        else:
            yield data(llama_final("", ev, gen, model))


def llama_final(text: str, done: Done, gen: Generation, model: str) -> dict:
    s = done.stats
    # llama-server's stop types: limit (n_predict), eos (end of generation), word (a stop)
    stop_type = "limit" if done.finish_reason == "length" else \
        "eos" if s.finish_reason == "stop" else "word"
    return {"content": text, "id_slot": gen.slot.id, "stop": True, "model": model,
            "tokens_predicted": s.n_predict, "tokens_evaluated": s.n_prompt,
            # what the slot's cache holds now: the prompt and the output but its last token
            "tokens_cached": max(s.n_prompt + s.n_predict - 1, 0),
            "stop_type": stop_type, "truncated": False, "timings": timings(s)}
