"""Request bodies, validated by pydantic (and published in the OpenAPI schema).

Every field specli honours is declared; a known OpenAI or llama-server parameter that specli
cannot honour is declared too, so that a request using it is refused (400) rather than
silently ignored; any other field is refused as unknown.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model
from pydantic_core import PydanticCustomError

from specli.config import DRY_BREAKERS_MAX, SAMPLING, SPEC_TYPES

MAX_MESSAGES = 65536


def at_most(n: int) -> BeforeValidator:
    """A list's length checked before its items: pydantic's max_length is checked after
    every item was validated (200,000 messages: 0.75 s on the event loop, to say no)."""

    def check(v):
        if isinstance(v, list) and len(v) > n:
            raise PydanticCustomError("too_long", "too many items",
                                      {"max_length": n, "actual_length": len(v)})
        return v
    return BeforeValidator(check)



class Strict(BaseModel):
    """Types as the OpenAI API checks them: "10" is not an integer, nor true a number."""

    model_config = ConfigDict(extra="forbid", strict=True)


class Speculative(Strict):
    """This request's own speculative settings (beyond llama.cpp): draft length bounds,
    the draft model's probability floor, and the --spec-type list to draft with."""

    n_max: Annotated[int, Field(ge=1, le=64)] | None = None
    n_min: Annotated[int, Field(ge=0, le=64)] | None = None
    p_min: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    type: Annotated[str, Field(
        description="llama.cpp --spec-type names, comma-separated: "
        + ", ".join(SPEC_TYPES))] | None = None


class StreamOptions(Strict):
    include_usage: bool = False


# llama-server's forms: {"15043": 1.0, "Hello": -2} or [[15043, 1.0], ["Hello", false]]; a
# string key is the tokens of that text, false bans
Bias = float | Literal[False]
# (a pair is a list: a tuple would refuse the JSON array in strict mode; routes check it)
Pair = Annotated[list[int | str | float | Literal[False]], Field(min_length=2, max_length=2)]
LogitBias = dict[str, Bias] | Annotated[list[Pair], at_most(65536), Field(max_length=65536)]


# llama-server's samplers specli does not have: name -> (type, what generation_settings
# reports, the values that leave the sampler off: any other is refused (routes); None: any,
# a setting of a sampler that is off)
ABSENT: dict[str, tuple[type, float, tuple[float, ...] | None]] = {
    "mirostat": (int, 0, (0,)), "mirostat_tau": (float, 5.0, None),
    "mirostat_eta": (float, 0.1, None), "typical_p": (float, 1.0, (1.0,)),
    "xtc_probability": (float, 0.0, (0.0,)), "xtc_threshold": (float, 0.1, None),
    "top_n_sigma": (float, -1.0, (-1.0, 0.0)), "dynatemp_range": (float, 0.0, (0.0,)),
    "dynatemp_exponent": (float, 1.0, None)}

# config.SAMPLING's parameters by their request names (temperature, top_p, seed...), and the
# absent samplers: their types here, their ranges where SamplingParams checks them (routes._job)
Knobs = create_model("Knobs", __base__=Strict, **{
    k.name: (k.kind | None, Field(default=None, description=k.help,
                                  json_schema_extra=k.schema() or None))
    for k in SAMPLING}, **{name: (kind | None, None) for name, (kind, _, _) in ABSENT.items()})


class Transforms(Knobs):
    """The sampling parameters and llama-server's logit transforms, on every generation route
    (OpenAI's two penalties are among them)."""

    logit_bias: LogitBias | None = None
    ignore_eos: bool | None = None  # generate past the end of generation
    dry_sequence_breakers: Annotated[list[str], Field(max_length=DRY_BREAKERS_MAX)] | None = None
    # constrained output (llama-server's): a GBNF grammar, or a JSON schema turned into one
    grammar: Annotated[str, Field(max_length=1 << 20)] | None = None
    json_schema: dict | None = None


class Sampling(Transforms):
    """What every generation route shares."""

    model: str | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: Speculative | bool | None = None
    timings_per_token: bool | None = None  # each streamed chunk carries the timings
    id_slot: Annotated[int, Field(ge=-1)] | None = None  # this slot (-1: any)
    return_progress: bool | None = None  # stream prompt_progress while the prompt runs
    # known, not served: refused with 400 when set to anything but their neutral value
    n: Annotated[int, Field(ge=1, le=16)] | None = None  # choices, one after another
    user: str | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


# the media parts llama-server reads (with a vision or audio projector): refused by the route
# with what they are, not by the validator with where its union failed
MEDIA = {"image_url": "image", "input_audio": "audio", "input_video": "video",
         "video_url": "video"}


class MediaPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["image_url", "input_audio", "input_video", "video_url"]


Part = TextPart | MediaPart  # not discriminated: its tag would enter the error's location


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # name...: passed to the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None


class SchemaWrapper(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # name, strict, description...

    schema_: dict = Field(default_factory=dict, alias="schema")


class ResponseFormat(Strict):
    """OpenAI's response_format; json_object may carry llama-server's own `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: SchemaWrapper | None = None
    schema_: dict | None = Field(default=None, alias="schema")


class ChatRequest(Sampling):
    # a bound the event loop can validate in well under a second (the context is the real one)
    messages: Annotated[list[Message], at_most(MAX_MESSAGES),
                        Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=100)] | None = None
    tools: Annotated[list[dict], Field(max_length=1024)] | None = None
    tool_choice: str | dict | None = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None
    # llama-server's: the template's own variables (enable_thinking...), where the answer's
    # reasoning goes (none: left in the content), OpenAI's reasoning effort (none: off)
    chat_template_kwargs: dict | None = None
    reasoning_format: str | None = None
    reasoning_effort: str | None = None
    # a final assistant message is continued (llama-server's prefill; vLLM's flag for it)
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
    verbose: bool | None = None  # llama-server's __verbose: the prompt as rendered


class CompletionRequest(Sampling):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | \
        Annotated[list[int], Field(min_length=1)]
    max_tokens: int | None = None
    n_predict: int | None = None  # llama-server's spelling of max_tokens
    cache_prompt: bool | None = None
    return_tokens: bool | None = None
    logprobs: Annotated[int, Field(ge=0, le=100)] | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class JsonPrompt(Strict):
    """llama-server's prompt object; multimodal data is refused (no vision in specli)."""

    prompt_string: str
    multimodal_data: list | None = None


class LlamaCompletionRequest(Transforms):
    """llama-server's own /completion."""

    # text; token ids, text mixed in; {"prompt_string": ...}; or a list of those (a batch,
    # answered with a list)
    prompt: str | JsonPrompt | Annotated[list[int | str | list[int | str] | JsonPrompt],
                                         at_most(65536), Field(min_length=1, max_length=65536)]
    n_predict: int | None = None
    stop: Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool = False
    cache_prompt: bool | None = None  # default true: reuse the slot's cached prefix
    speculative: Speculative | bool | None = None
    # llama-server's flat spellings of the same (compiled out there, honoured here)
    spec_n_max: Annotated[int | None, Field(ge=1, le=64, alias="speculative.n_max")] = None
    spec_n_min: Annotated[int | None, Field(ge=0, le=64, alias="speculative.n_min")] = None
    spec_p_min: Annotated[float | None, Field(ge=0.0, le=1.0,
                                              alias="speculative.p_min")] = None
    spec_type: Annotated[str | None, Field(alias="speculative.type")] = None
    timings_per_token: bool | None = None
    return_progress: bool | None = None
    id_slot: Annotated[int, Field(ge=-1)] | None = None
    n_probs: Annotated[int, Field(ge=0, le=100)] | None = None
    post_sampling_probs: bool | None = None
    return_tokens: bool | None = None
    response_fields: Annotated[list[str], Field(max_length=256)] | None = None


class TokenizeRequest(Strict):
    """llama-server's /tokenize: text, or text and token ids mixed."""

    content: str | list[int | str]
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(Strict):
    tokens: list[int]
