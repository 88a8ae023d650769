"""batching.SharedContext on the real Q4_1 model: slots' decodes are combined into one batch,
every decode runs on the loop's one thread, in batches that depend on nothing timed, and a
failed combined decode reaches every slot."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from concurrency import as_tasks

from specli.backend import Model
from specli.batching import SharedContext
from specli.config import ModelParams
from specli.errors import BackendError


@pytest.fixture
def shared(q4_1):
    ctx = SharedContext(ModelParams(q4_1, n_ctx=128, n_threads=1), n_seq=2)
    yield ctx
    ctx.close()


def in_slots(shared: SharedContext, work) -> list:
    """Slots 0, 1, ... run work[i](the slot's Model) at the same time, as tasks of the
    context's loop; each one's result, or the exception it got."""
    return as_tasks(shared.sched, lambda i: work[i](shared.view(i)), len(work), 120,
                    keep_errors=True)


def two_slots(shared: SharedContext, steps: int) -> list:
    """Two slots decode a prompt, then `steps` single tokens each, at the same time; returns
    each slot's outcome (its last rows, or the exception it got)."""
    def work(i: int):
        def run(m: Model):
            rows = m.decode([1, 2, 3, 4 + i])
            for t in range(steps):
                rows = m.decode([10 + t])
            return rows
        return run

    return in_slots(shared, [work(0), work(1)])


def test_decodes_are_combined_and_run_on_the_decode_thread(shared, monkeypatch):
    runs = []
    real = SharedContext._run

    def spy(self, batch):
        runs.append((threading.current_thread().name, len(batch)))
        return real(self, batch)

    monkeypatch.setattr(SharedContext, "_run", spy)
    out = two_slots(shared, steps=4)
    assert all(r.shape == (1, shared.view(0).n_vocab) for r in out), out
    assert {name.split("_")[0] for name, _ in runs} == {"specli-decode"}
    # every decode once, combined: the loop decodes when both slots are parked, with no
    # timing in it (the same batches every run)
    assert [size for _, size in runs] == [2] * 5, runs


def test_a_failed_combined_decode_reaches_every_slot(shared, monkeypatch):
    def broken(self, items):
        raise BackendError("llama_decode failed (test)")

    monkeypatch.setattr(Model, "decode_items", broken)
    out = two_slots(shared, steps=0)
    assert all(isinstance(e, BackendError) and "(test)" in e.message for e in out), out


def test_a_slots_sequence_and_its_context_are_backends(shared):
    """A slot's sequence is a Model like any other (its decodes and edits run through the
    shared context), and both are what the engine takes (backend.Backend)."""
    from specli.backend import Backend

    view = shared.view(1)
    assert isinstance(view, Model) and isinstance(view, Backend)
    assert isinstance(shared.base, Backend)
    view.decode([1, 2, 3])
    assert view.kv_pos_max() == 2 and shared.view(0).kv_pos_max() == -1


def test_a_long_prompt_is_decoded_in_chunks_between_the_other_slots_steps(f32, monkeypatch):
    """llama-server's prompt processing inside its iterations: a prompt longer than a chunk
    (n_ubatch) is decoded a chunk a batch, beside the other slots' steps, not in one decode
    that holds them up; its last row is the one a lone decode of the prompt gives."""
    params = ModelParams(f32, n_ctx=256, n_threads=1, n_batch=64, n_ubatch=16)
    ctx = SharedContext(params, n_seq=2)
    runs: list[list[tuple[int, int]]] = []
    real = SharedContext._run

    def spy(self, batch):
        runs.append([(r.seq, r.take) for r in batch])
        return real(self, batch)

    monkeypatch.setattr(SharedContext, "_run", spy)
    prompt = list(range(300, 400))

    def steps(m: Model) -> bool:
        m.decode([1, 2, 3])
        for t in range(12):
            m.decode([10 + t])
        return True

    try:
        out = in_slots(ctx, [lambda m: m.decode(prompt), steps])
    finally:
        ctx.close()
    # the other slot's steps go on between the chunks: its prompt and 6 steps beside the 6
    # full chunks and the rest (the same batches every run: nothing in it is timed)
    assert runs == [[(1, 3), (0, 16)], *[[(1, 1), (0, 16)]] * 5, [(1, 1), (0, 4)],
                    *[[(1, 1)]] * 6], runs
    alone = Model(ModelParams(f32, n_ctx=256, n_threads=1, n_batch=64, n_ubatch=16))
    try:
        want = np.array(alone.decode(prompt))  # a copy: the rows are a view
    finally:
        alone.close()
    assert out[1] is True and int(out[0][-1].argmax()) == int(want[-1].argmax())
    assert abs(out[0][-1] - want[-1]).max() < 1e-3


def test_a_context_closes_once_and_refuses_decodes_after(q4_1):
    """Closing twice is harmless (the second finds the loop ended), and a decode after the
    close is a clear BackendError, not a hang."""
    ctx = SharedContext(ModelParams(q4_1, n_ctx=64, n_threads=1), n_seq=1)
    view = ctx.view(0)
    ctx.close()
    ctx.close()
    with pytest.raises(BackendError):
        view.decode([1, 2])


def test_a_sequence_adopted_holds_the_others_cache_before_either_writes(f32):
    """Model.adopt (a server slot taking over another's cached prompt): the copy holds the
    source's cells as they were, even when the source rewinds and decodes something else in
    the very decode that first reads the copy; its next row is the source's own."""
    ctx = SharedContext(ModelParams(f32, n_ctx=64, n_threads=1), n_seq=3)
    a, b = ctx.view(0), ctx.view(2)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    try:
        # the row that follows the prompt, from a lone decode of it (slot 0 is empty)
        want = np.array(ctx.sched.submit(lambda: b.decode(prompt)).result())
        ctx.sched.submit(lambda: b.rewind(len(prompt) - 1)).result()
        assert ctx.sched.submit(lambda: a.adopt(b)).result()
        assert a.tokens == prompt[:-1] and not a.adopt(a)

        def source(m: Model):
            m.rewind(2)
            return np.array(m.decode([50, 51, 52]))

        def taker(m: Model):
            return np.array(m.decode(prompt[-1:]))

        _, got = as_tasks(ctx.sched, lambda i: [source, taker][i]([b, a][i]), 2, 120)
    finally:
        ctx.close()
    # (a combined decode of another shape: F32's drift, far below a wrong cache's)
    assert int(got[-1].argmax()) == int(want[-1].argmax())
    assert abs(got[-1] - want[-1]).max() < 0.02


def test_the_plan_is_told_the_steps_a_context_decodes_but_not_catch_ups(q4_1):
    """`timed` (--draft auto's cost lines) gets each decode of equal steps of consecutive
    slots, every row wanted (a plain step, a verification, a drafting position): its
    tokens in all and its seconds; a short prompt (its last row) is no step, and a draft's
    catch-up (no rows) is timed by the plan apart: neither is a point of the line."""
    told: list[tuple[int, float]] = []
    ctx = SharedContext(ModelParams(q4_1, n_ctx=128, n_threads=1), n_seq=2,
                        timed=lambda n, s: told.append((n, s)))
    try:
        def work(m: Model) -> None:
            m.decode([1, 2, 3, 4, 5], logits="none")  # a catch-up of 5 tokens
            m.decode([9, 10, 11], logits="last")  # a short prompt: its last row
            m.decode([6], logits="last")  # a drafting position
            m.decode([7, 8], logits="all")  # a verification of 2

        in_slots(ctx, [work, work])
    finally:
        ctx.close()
    assert [n for n, _ in told] == [2, 4] and all(s > 0 for _, s in told)
