"""How answers are written: usage, llama-server's timings, and server-sent event streams (one
chunker for OpenAI's chat and completion streams, one for llama-server's /completion)."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable

from fastapi.responses import Response, StreamingResponse

from specli.config import SAMPLING
from specli.errors import BackendError, SpecliError
from specli.server.errors import APIError
from specli.server.schemas import ABSENT
from specli.server.slots import Done, Generation, Piece, Progress
from specli.server.streams import Session, tee
from specli.server.tools import Read
from specli.stats import Stats
from specli.verify import TokenProbs


def finish(done: Done) -> str:
    return "length" if done.finish_reason == "length" else "stop"


def cached(s: Stats) -> int:
    """Prompt tokens taken from the slot's cache, not evaluated (llama-server's cache_n)."""
    return max(s.n_prompt - (s.target.prompt_n + 1), 0) if s.n_prompt else 0


def speculative(s: Stats) -> dict:
    """What speculation did: drafts verified, tokens (a tree's nodes) drafted and accepted,
    the acceptance rate at each draft position (1 = the first drafted token), and with draft
    trees the branches drafted."""
    out = {"drafts": s.n_steps, "plain_steps": s.n_plain, "draft_n": s.n_drafted,
           "draft_n_accepted": s.n_accept,
           "accept_rate": round(s.accept_rate, 4),
           "accepted_per_position": [round(r, 4) for r in s.accept_rate_per_pos]}
    if s.n_seq_dft > 1:
        out.update(n_seq=s.n_seq_dft, branches=s.n_branches)
    return out


def usage(s: Stats) -> dict:
    return {"prompt_tokens": s.n_prompt, "completion_tokens": s.n_predict,
            "total_tokens": s.n_prompt + s.n_predict,
            "prompt_tokens_details": {"cached_tokens": cached(s)},
            "speculative": speculative(s)}


def usage_of(dones: list[Done]) -> dict:
    """The usage of n choices: the prompt once, every choice's completion."""
    out = usage(dones[0].stats)
    if len(dones) > 1:
        n = sum(d.stats.n_predict for d in dones)
        spec = out["speculative"]
        spec["drafts"] = sum(d.stats.n_steps for d in dones)
        spec["plain_steps"] = sum(d.stats.n_plain for d in dones)
        spec["draft_n"] = sum(d.stats.n_drafted for d in dones)
        spec["draft_n_accepted"] = sum(d.stats.n_accept for d in dones)
        spec["accept_rate"] = round(spec["draft_n_accepted"] / spec["draft_n"], 4) \
            if spec["draft_n"] else 0.0
        drafted = [sum(col) for col in _columns([d.stats.drafted_per_pos for d in dones])]
        accepted = [sum(col) for col in _columns([d.stats.accepted_per_pos for d in dones])]
        spec["accepted_per_position"] = [round(a / d, 4) if d else 0.0
                                         for a, d in zip(accepted, drafted, strict=True)]
        out.update(completion_tokens=n, total_tokens=out["prompt_tokens"] + n)
    return out


def _columns(rows: list[list[int]]) -> list[list[int]]:
    width = max((len(r) for r in rows), default=0)
    return [[r[i] if i < len(r) else 0 for r in rows] for i in range(width)]


def timings(s: Stats) -> dict:
    """llama-server's timings object, numbers only, computed as llama-server computes them:
    the first token comes with the prompt's logits there, so its time is the prompt's and
    the generation rate counts the tokens after it (here: after the first step's tokens,
    one plus any accepted draft; an answer that ends within it has a rate of 0, as
    llama-server's test_metrics_generation_rate_excludes_first_token defines it). The
    draft totals are here; the acceptance per draft position is in the `speculative`
    object."""
    prompt_n = s.target.prompt_n + 1 if s.n_prompt else 0  # the last prompt token opens step 1
    prompt_ms = 1e3 * (s.t_encode_s + s.t_first_s)
    predicted_ms = 1e3 * max(s.t_decode_s - s.t_first_s, 0.0)
    after = max(s.n_predict - s.n_first, 0)
    if not after:
        predicted_ms = 0.0
    return {"cache_n": cached(s),
            "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms else 0.0,
            "predicted_n": s.n_predict, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / after if after else 0.0,
            "predicted_per_second": 1e3 * after / predicted_ms if predicted_ms else 0.0,
            "draft_n": s.n_drafted, "draft_n_accepted": s.n_accept,
            "draft_accept_rate": s.accept_rate,
            # beyond llama-server: steps that verified a draft, and steps of the target alone
            # (--draft auto choosing 0 in a full batch, or nothing to propose)
            "draft_steps": s.n_steps, "plain_steps": s.n_plain}


def progress_json(p: Progress) -> dict:
    """A prompt-progress chunk's fields: prompt_progress, and with timings_per_token the
    timings so far, as llama-server sends them (the prompt's tokens decoded and their time;
    nothing predicted yet; the first update, before any decode, all zeros)."""
    out = {"prompt_progress": p.progress}
    if p.timed:
        pr = p.progress
        n = max(pr["processed"] - pr["cache"], 0)
        ms = pr["time_ms"] if n else 0.0
        out["timings"] = {"cache_n": pr["cache"], "prompt_n": n, "prompt_ms": ms,
                          "prompt_per_token_ms": ms / n if n else 0.0,
                          "prompt_per_second": 1e3 * n / ms if ms else 0.0,
                          "predicted_n": 0, "predicted_ms": 0.0,
                          "predicted_per_token_ms": 0.0, "predicted_per_second": 0.0}
    return out


_LOWEST = -3.4028234663852886e38  # log(0) as llama-server writes it (JSON has no -inf)


def _log(p: float) -> float:
    return math.log(p) if p > 0 else _LOWEST


def _piece(model, token: int) -> tuple[str, list[int]]:
    raw = model.token_bytes(token)
    return raw.decode("utf-8", "ignore"), list(raw)


def probs_json(model, probs: list[TokenProbs], post: bool = False) -> list[dict]:
    """llama-server's per-token probabilities (also the OpenAI chat logprobs `content`):
    logprob and top_logprobs, or prob and top_probs after the sampling chain."""
    key, top_key, val = ("prob", "top_probs", float) if post else \
        ("logprob", "top_logprobs", _log)
    out = []
    for tp in probs:
        text, raw = _piece(model, tp.token)
        top = []
        for i, p in tp.top:
            t, b = _piece(model, i)
            top.append({"id": i, "token": t, "bytes": b, key: val(p)})
        out.append({"id": tp.token, "token": text, "bytes": raw, key: val(tp.prob),
                    top_key: top})
    return out


def legacy_logprobs(model, probs: list[TokenProbs], offset: int = 0) -> dict:
    """OpenAI's completions logprobs (tokens, token_logprobs, top_logprobs, text_offset),
    with llama-server's `content` form beside them."""
    tokens, offsets = [], []
    for tp in probs:
        offsets.append(offset)
        text = _piece(model, tp.token)[0]
        tokens.append(text)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [_log(tp.prob) for tp in probs],
            "top_logprobs": [{_piece(model, i)[0]: _log(p) for i, p in tp.top}
                             for tp in probs],
            "text_offset": offsets, "content": probs_json(model, probs)}


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering


def data(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def sse(events: AsyncIterator[str], gen: Generation, done_marker: bool = True,
        on_error: Callable[[str, str, str | None], str] | None = None,
        session: Session | None = None) -> Response:
    """A stream of events; an error once the status line is sent is said in the stream:
    OpenAI's error chunk, or on_error(type, message, code) for another API's own event. With
    a session (a request's X-Conversation-Id, server/streams.py) the stream is kept there and
    runs to its end whether or not the client stays."""
    async def body() -> AsyncIterator[str]:
        try:
            async for line in events:
                yield line
            if done_marker:
                yield "data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - the status line is sent: say it in the stream
            kind = "invalid_request_error" if isinstance(e, SpecliError) and not isinstance(
                e, BackendError) else "server_error"
            code = None
            if isinstance(e, APIError):  # the server's own answer (an RPC server lost: 503)
                kind, code = e.type, e.code
            message = getattr(e, "message", None) or str(e)
            yield on_error(kind, message, code) if on_error is not None else data(
                {"error": {"message": message, "type": kind, "param": None, "code": code}})
        finally:
            gen.cancel()  # a client that went away frees its slot at the next token

    return StreamingResponse(body() if session is None else tee(body(), session, gen.cancel),
                             media_type="text/event-stream",
                             headers=SSE_HEADERS)


# choice(read, finish_reason, logprobs) -> one choice of a chunk: chat's delta or completion's
# text
Choice = Callable[[Read, str | None, dict | None], dict]


def chat_choice(delta: Callable[[Read], dict]) -> Choice:
    """Chat's chunk choice, its delta written by delta (server/tools.ChatPlan.delta); a
    finished answer that called a tool finishes with tool_calls."""
    def choice(r: Read, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        if finish_reason == "stop" and r.called:
            finish_reason = "tool_calls"
        return {"index": r.index, "delta": delta(r), "logprobs": logprobs,
                "finish_reason": finish_reason}
    return choice


def text_choice(r: Read, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": r.index, "text": r.delta.content, "logprobs": logprobs,
            "finish_reason": finish_reason}


def chat_logprobs(gen: Generation, probs: list[TokenProbs]) -> dict | None:
    sp = gen.job.sampling
    if sp.n_probs is None:
        return None
    return {"content": probs_json(gen.slot.engine.target, probs, sp.post_sampling_probs)}


def text_logprobs(gen: Generation, probs: list[TokenProbs], offset: int = 0) -> dict | None:
    if gen.job.sampling.n_probs is None:
        return None
    return legacy_logprobs(gen.slot.engine.target, probs, offset)


async def openai_events(reads: AsyncIterator[Read | Progress], head: dict, choice: Choice,
                        with_usage: bool, first: list[dict] | None = None,
                        logprobs: Callable[[list, int], dict | None] | None = None,
                        ) -> AsyncIterator[str]:
    """An OpenAI stream: optional first chunks (one per choice), one chunk per piece read,
    each choice's finish reason, then (stream_options.include_usage) a chunk with no choices
    and the usage. logprobs writes a piece's token probabilities (from the piece's offset in
    its choice's text)."""
    for c in first or ():
        yield data({**head, "choices": [c]})
    offset: dict[int, int] = {}
    dones: list[Done] = []
    async for r in reads:
        if isinstance(r, Progress):
            yield data({**head, "choices": [], **progress_json(r)})
        elif r.done is None:
            piece = r.piece
            at = offset.get(r.index, 0)
            lp = logprobs(piece.probs, at) if logprobs is not None else None
            offset[r.index] = at + len(piece.text)
            d = r.delta
            if not (d.content or d.reasoning or d.calls) and lp is None and piece.stats is None:
                continue  # nothing to send yet: a character's first bytes, a call being written
            c = choice(r, None, lp)
            chunk = {**head, "choices": [c]}
            if piece.stats is not None:
                chunk["timings"] = timings(piece.stats)
            yield data(chunk)
        else:
            dones.append(r.done)
            yield data({**head, "choices": [choice(r, finish(r.done), None)]})
    if with_usage and dones:
        yield data({**head, "choices": [], "usage": usage_of(dones),
                    "timings": timings(dones[0].stats)})


async def llama_events(gen: Generation, model: str, gs: dict) -> AsyncIterator[str]:
    sp = gen.job.sampling
    async for ev in gen.events():
        if isinstance(ev, Progress):
            yield data({"index": 0, "content": "", "tokens": [], "stop": False,
                        "id_slot": gen.slot.id, **progress_json(ev)})
        elif isinstance(ev, Piece):
            out = {"index": 0, "content": ev.text, "tokens": ev.tokens, "stop": False,
                   "id_slot": gen.slot.id}
            if ev.stats is not None:
                out["timings"] = timings(ev.stats)
            if sp.n_probs is not None and ev.probs:
                out["completion_probabilities"] = probs_json(
                    gen.slot.engine.target, ev.probs, sp.post_sampling_probs)
            yield data(out)
        else:
            yield data(llama_final("", ev, gen, model, gs, stream=True))


def llama_final(text: str, done: Done, gen: Generation, model: str, gs: dict,
                stream: bool = False) -> dict:
    """llama-server's /completion answer (gs: the request's generation_settings)."""
    s, job = done.stats, gen.job
    # llama-server's stop types: limit (n_predict), eos (end of generation), word (a stop)
    stop_type = "limit" if done.finish_reason == "length" else \
        "eos" if s.finish_reason == "stop" and not done.stopping_word else "word"
    out = {"index": 0, "content": text,
           "tokens": done.tokens if job.return_tokens else [],
           "id_slot": gen.slot.id, "stop": True, "model": model,
           "tokens_predicted": s.n_predict, "tokens_evaluated": s.n_prompt,
           "generation_settings": gs, "prompt": job.prompt_text,
           "has_new_line": "\n" in text, "truncated": s.truncated, "stop_type": stop_type,
           "stopping_word": done.stopping_word,
           # what the slot's cache holds now: the prompt and the output but its last token
           "tokens_cached": max(s.n_prompt + s.n_predict - 1, 0),
           "timings": timings(s), "speculative": speculative(s)}
    if not stream and job.sampling.n_probs is not None:
        out["completion_probabilities"] = probs_json(gen.slot.engine.target, done.probs,
                                                     job.sampling.post_sampling_probs)
    return out


def pick(doc: dict, paths: list[str]) -> dict:
    """llama-server's response_fields: only these fields, "a/b" reaching into objects, each
    under its path as written; a path that leads nowhere is left out."""
    out = {}
    for path in paths:
        cur = doc
        for key in path.split("/"):
            if not isinstance(cur, dict) or key not in cur:
                break
            cur = cur[key]
        else:
            out[path] = cur
    return out


# specli's sampling chain, in llama.cpp's names (verify.py): logit bias first, always
SAMPLERS = ("penalties", "dry", "top_k", "top_p", "min_p", "temperature")


def bias_json(logit_bias) -> list[dict]:
    """(token, bias) pairs as llama-server writes them: a ban (-inf, which JSON cannot
    spell) is null, as nlohmann's JSON writes a non-finite number (a request says false)."""
    return [{"token": t, "bias": b if math.isfinite(b) else None} for t, b in logit_bias]


def settings(sp, n_predict: int, stop=(), policy=None, speculative: bool = True,
             types: tuple[str, ...] = ()) -> dict:
    """Generation settings as llama-server reports them (a /completion answer's
    generation_settings, /props' default_generation_settings.params): these sampling
    parameters, this n_predict and stop list, and the draft policy in effect. The samplers
    specli does not have are at their neutral values, the only ones it accepts."""
    out = {k.name: getattr(sp, k.field) for k in SAMPLING}
    out.update({name: reported for name, (_, reported, _) in ABSENT.items()})
    out.update({"seed": -1 if sp.seed is None else sp.seed,
                "dry_sequence_breakers": list(sp.dry_sequence_breakers),
                "adaptive_target": -1.0, "adaptive_decay": 0.9,  # llama-server's: off
                "stop": list(stop), "max_tokens": n_predict, "n_predict": n_predict,
                "n_keep": 0, "n_discard": 0, "logit_bias": bias_json(sp.logit_bias),
                "n_probs": sp.n_probs or 0, "min_keep": 0, "grammar": sp.grammar or "",
                "post_sampling_probs": sp.post_sampling_probs, "samplers": list(SAMPLERS),
                "speculative": speculative})
    if policy is not None:
        out.update({"speculative.n_max": policy.n_draft, "speculative.n_min": policy.n_min,
                    "speculative.p_min": policy.p_min, "speculative.types": ",".join(types),
                    "speculative.sampling": policy.sampling})
    return out
