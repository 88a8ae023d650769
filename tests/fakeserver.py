"""The server on fake engines: create_app over a State whose slots hold FakeModel targets
(and drafts), served in process through httpx's ASGI transport (Starlette's TestClient). For
the protocol and validation tests, where the model's text does not matter: no model file, no
subprocess, a request answered in milliseconds. Fidelity stays with the real-model tests
(test_serve.py, test_serve_features.py, test_parity.py)."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import replace

import openai
from fakes import EOG, FakeModel
from fastapi.testclient import TestClient

from specli.config import ModelParams, SamplingParams
from specli.plan import SpecPlan, engine
from specli.server.app import ServerConfig, State, create_app
from specli.server.slots import Slot, SlotPool

KEY = "sk-fake"


class ServerFake(FakeModel):
    """FakeModel with a vocabulary of bytes (text round-trips: a prompt comes back as it was
    sent) and what a server's slot reads of its target besides the loop: the
    end-of-generation tokens, its ModelParams, a chat template (none: ChatML)."""

    def __init__(self, n_ctx: int = 512, template: str | None = None, **kw):
        super().__init__(n_vocab=256, n_ctx=n_ctx, **kw)
        self.params = ModelParams(path="fake.gguf", n_ctx=n_ctx)
        self.eog = (EOG,)
        self.grammar_source = None
        self.template = template

    def chat_template(self) -> str | None:
        return self.template

    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = True) -> list[int]:
        return [b for b in text.encode("utf-8", "surrogatepass") if b != EOG]

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        return b"" if token == EOG else bytes([token])


class FakeState(State):
    """State whose load() builds its slots on ServerFake models (a draft of the same table with
    noise when the config has a draft), through the plan, as State.load does on real ones.
    model: FakeModel's own arguments (eog_bias: how often a generation ends)."""

    def __init__(self, config: ServerConfig, **model):
        super().__init__(config)
        self.model = model

    def load(self) -> None:
        c, engines = self.config, []
        n_ctx = max(c.target.n_ctx // c.parallel, 16)
        for _ in range(c.parallel):
            target = ServerFake(n_ctx=n_ctx, **self.model)
            draft = ServerFake(n_ctx=n_ctx, noise=0.5, **{
                k: v for k, v in self.model.items() if k != "template"}) if c.draft else None
            engines.append(engine(self.plan, target, draft))
        self.pool = SlotPool([Slot(i, e) for i, e in enumerate(engines)], c.max_queue,
                             c.timeout, on_done=self.metrics.observe,
                             similarity=c.slot_similarity, on_close=self.close_grammars)


def config(**kw) -> ServerConfig:
    """A fake server's config: greedy, 16 tokens, one slot, the key KEY; `draft=True` gives
    it a draft model."""
    draft = kw.pop("draft", False)
    base = ServerConfig(target=ModelParams(path="fake.gguf", n_ctx=512),
                        draft=ModelParams(path="fake-draft.gguf", n_ctx=512) if draft else None,
                        plan=SpecPlan.resolve((), draft),
                        sampling=SamplingParams(temp=0.0), n_predict=16, api_keys=(KEY,),
                        aliases=("fake",))
    return replace(base, **kw)


@contextmanager
def serve(cfg: ServerConfig | None = None, *, key: str | None = KEY, **model):
    """A client of the app on a fake state, its slots loaded; `key` goes in every request;
    model: FakeModel's arguments."""
    st = FakeState(cfg or config(api_keys=(key,) if key else ()), **model)
    st.load()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    app = create_app(st.config, state=st)
    with TestClient(app, headers=headers) as client:
        client.state = st
        # no key, no headers of the client's; not started again (its end would stop the app)
        client.anon = lambda: nullcontext(TestClient(app))
        # the OpenAI package as the client, over this one
        client.openai = lambda: openai.OpenAI(api_key=key or "none", http_client=client,
                                              base_url=f"{client.base_url}/v1")
        yield client
