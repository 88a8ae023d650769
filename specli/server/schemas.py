"""Request bodies, validated by pydantic (and published in the OpenAPI schema).

Every field specli honours is declared; a known OpenAI or llama-server parameter that specli
cannot honour is declared too, so that a request using it is refused (400) rather than
silently ignored; any other field is refused as unknown.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    create_model,
    model_validator,
)
from pydantic_core import PydanticCustomError

from specli.config import DRAFTING, DRY_BREAKERS_MAX, SAMPLING, SPEC_SAMPLING, SPEC_TYPES

# Counts checked before validation, which runs on the event loop: each message, part or
# field costs it microseconds (250,000 parts held /health for 1.4 s, 65,536 messages 0.5 s)
MAX_MESSAGES = 16384
MAX_PARTS = 16384  # content parts (or blocks, or items' parts) over a request's messages
MAX_TOOLS = 1024
MAX_FIELDS = 64  # of a message, a call, a tool: the extra ones pass on to the template
MAX_KEYS = 4096  # of one JSON object a client sends (a schema, the template's variables)
MAX_METADATA = 16  # OpenAI's limit on a request's metadata


def at_most(n: int) -> BeforeValidator:
    """A list's length checked before its items: pydantic's max_length is checked after
    every item was validated (200,000 messages: 0.75 s on the event loop, to say no)."""

    def check(v):
        if isinstance(v, list) and len(v) > n:
            raise PydanticCustomError("too_long", "too many items",
                                      {"max_length": n, "actual_length": len(v)})
        return v
    return BeforeValidator(check)


def keys_at_most(n: int) -> BeforeValidator:
    """An object's keys counted before its values are validated."""

    def check(v):
        if isinstance(v, dict) and len(v) > n:
            raise PydanticCustomError("too_long", "too many keys",
                                      {"max_length": n, "actual_length": len(v)})
        return v
    return BeforeValidator(check)


Obj = Annotated[dict, keys_at_most(MAX_KEYS)]  # any JSON object
Metadata = Annotated[dict, keys_at_most(MAX_METADATA)]


def parts_at_most(n: int) -> BeforeValidator:
    """The parts of a list of messages (content parts, blocks, a tool result's parts, a
    call's list), all together, counted before any is validated, and no further than the
    limit: the count costs at most n steps."""

    def check(v):
        if not isinstance(v, list):
            return v
        total = 0
        for m in v:
            for field in m.values() if isinstance(m, dict) else ():
                if not isinstance(field, list):
                    continue
                total += len(field)
                for item in field if total <= n else ():  # a block's own list (a tool
                    for inner in item.values() if isinstance(item, dict) else ():  # result's)
                        if isinstance(inner, list):
                            total += len(inner)
            if total > n:
                raise PydanticCustomError("too_long", "too many content parts in all",
                                          {"max_length": n})
        return v
    return BeforeValidator(check)


def tagged(known: dict[str, type], other: type, default: str | None = None):
    """A union told apart by each item's `type` (default where it has none): a type not in
    `known` is `other`, which the route reads or refuses in its own words."""

    # (each tag has a "-": errors.py leaves such a part out of a field's name)
    def tag(v) -> str:
        kind = v.get("type", default) if isinstance(v, dict) else getattr(v, "type", default)
        return f"type-{kind if isinstance(kind, str) and kind in known else '-other'}"

    members = tuple(Annotated[m, Tag(f"type-{k}")]
                    for k, m in {**known, "-other": other}.items())
    return Annotated[Union[members], Discriminator(tag)]  # noqa: UP007 - a built tuple



class Strict(BaseModel):
    """Types as the OpenAI API checks them: "10" is not an integer, nor true a number."""

    model_config = ConfigDict(extra="forbid", strict=True)


class Open(BaseModel):
    """A shape whose fields beyond the declared ones pass on (to the template: a message's
    name, a tool's strict...): strict types, and at most MAX_FIELDS fields, counted before
    any is validated."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _few_fields(cls, data):
        if isinstance(data, dict) and len(data) > MAX_FIELDS:
            raise PydanticCustomError("too_long", "too many fields",
                                      {"max_length": MAX_FIELDS, "actual_length": len(data)})
        return data


# this request's own speculative settings (beyond llama.cpp): config.DRAFTING's by their
# names, whose ranges SpecRequest checks (jobs.spec_of), and the --spec-type list
Speculative = create_model("Speculative", __base__=Strict, **{
    k.name: (k.kind | None, Field(default=None, description=k.help,
                                  json_schema_extra=k.schema() or None)) for k in DRAFTING},
    type=(str | None, Field(default=None, description="llama.cpp --spec-type names, "
                            "comma-separated: " + ", ".join(SPEC_TYPES))),
    sampling=(Literal[SPEC_SAMPLING] | None, Field(  # type: ignore[valid-type]
        default=None, description="how a sampled draft is verified (--spec-sampling)")))
# llama-server's flat spellings of the same on /completion ("speculative.n_max"...)
FlatSpeculative = create_model("FlatSpeculative", __base__=Strict, **{
    f"spec_{k.field}": (k.kind | None, Field(default=None, alias=f"speculative.{k.name}"))
    for k in DRAFTING}, spec_type=(str | None, Field(default=None, alias="speculative.type")),
    spec_sampling=(Literal[SPEC_SAMPLING] | None,  # type: ignore[valid-type]
                   Field(default=None, alias="speculative.sampling")))


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
# absent samplers: their types here, their ranges where SamplingParams checks them (jobs.job)
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
    json_schema: Obj | None = None


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


class MediaPart(Open):
    type: Literal["image_url", "input_audio", "input_video", "video_url"]


Part = TextPart | MediaPart  # not discriminated: its tag would enter the error's location


class FunctionCall(Open):
    name: str
    # JSON text, as OpenAI sends it (an object is read too; null as none)
    arguments: Annotated[str | Obj, BeforeValidator(lambda v: "" if v is None else v)] = ""


class ToolCallIn(Open):
    """An assistant's earlier call, in the conversation sent back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    tool_calls: Annotated[list[ToolCallIn], at_most(MAX_TOOLS)] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None


class FunctionDef(Open):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: Obj | None = None  # a JSON schema


class Tool(Open):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(Open):
    name: str


class NamedToolChoice(Open):
    """tool_choice naming one function: {"type": "function", "function": {"name": ...}}."""

    type: Literal["function"]
    function: NamedFunction


class SchemaWrapper(Open):  # name, strict, description...
    schema_: Obj = Field(default_factory=dict, alias="schema")


class ResponseFormat(Strict):
    """OpenAI's response_format; json_object may carry llama-server's own `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: SchemaWrapper | None = None
    schema_: Obj | None = Field(default=None, alias="schema")


class ChatRequest(Sampling):
    # a bound the event loop can validate in well under a second (the context is the real one)
    messages: Annotated[list[Message], at_most(MAX_MESSAGES), parts_at_most(MAX_PARTS),
                        Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=100)] | None = None
    tools: Annotated[list[Tool], at_most(MAX_TOOLS), Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None
    # llama-server's: the template's own variables (enable_thinking...), where the answer's
    # reasoning goes (none: left in the content), OpenAI's reasoning effort (none: off)
    chat_template_kwargs: Obj | None = None
    reasoning_format: str | None = None
    reasoning_effort: str | None = None
    # a final assistant message is continued (llama-server's prefill; vLLM's flag for it)
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
    verbose: bool | None = None  # llama-server's __verbose: the prompt as rendered


class CompletionRequest(Sampling):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | \
        Annotated[list[int], at_most(MAX_IDS), Field(min_length=1)]
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


class LlamaCompletionRequest(Transforms, FlatSpeculative):
    """llama-server's own /completion (the flat speculative spellings: compiled out there,
    honoured here)."""

    # text; token ids, text mixed in; {"prompt_string": ...}; or a list of those (a batch,
    # answered with a list)
    prompt: str | JsonPrompt | Annotated[list[int | str | list[int | str] | JsonPrompt],
                                         at_most(65536), Field(min_length=1, max_length=65536)]
    n_predict: int | None = None
    stop: Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool = False
    cache_prompt: bool | None = None  # default true: reuse the slot's cached prefix
    speculative: Speculative | bool | None = None
    timings_per_token: bool | None = None
    return_progress: bool | None = None
    id_slot: Annotated[int, Field(ge=-1)] | None = None
    n_probs: Annotated[int, Field(ge=0, le=100)] | None = None
    post_sampling_probs: bool | None = None
    return_tokens: bool | None = None
    response_fields: Annotated[list[str], Field(max_length=256)] | None = None


MAX_IDS = 1 << 20  # token ids in one list: more than any context holds


class TokenizeRequest(Strict):
    """llama-server's /tokenize: text, or text and token ids mixed."""

    content: str | Annotated[list[int | str], at_most(MAX_IDS)]
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(Strict):
    tokens: Annotated[list[int], at_most(MAX_IDS)]


# -- other vendors' APIs over the chat machinery (server/compat.py) ---------------------------

class Lenient(BaseModel):
    """A body of another vendor's API: the fields specli reads typed as that API types them;
    any other field ignored (clients send metadata, cache_control and the like)."""

    model_config = ConfigDict(extra="ignore", strict=True)


class Other(Lenient):
    """A block, part or item of a type specli does not read (the route says what to do)."""

    type: str


class TextBlock(Lenient):
    type: Literal["text"]
    text: str


class ImageBlock(Lenient):
    type: Literal["image"]


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: Obj = Field(default_factory=dict)


class ToolResultBlock(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[tagged({"text": TextBlock, "image": ImageBlock}, Other)] | None = None
    is_error: bool | None = None


class ThinkingBlock(Lenient):
    type: Literal["thinking"]
    thinking: str


Block = tagged({"text": TextBlock, "image": ImageBlock, "tool_use": ToolUseBlock,
                "tool_result": ToolResultBlock, "thinking": ThinkingBlock}, Other)


class AnthropicMessage(Lenient):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(Lenient):
    name: str
    description: str | None = None
    input_schema: Obj | None = None


class AnthropicToolChoice(Lenient):
    type: Literal["auto", "any", "none", "tool"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicThinking(Lenient):
    type: str
    budget_tokens: int | None = None


# another vendor's body with config.SAMPLING's parameters by their request names (its own
# temperature, top_p and top_k among them; llama.cpp's others as llama-server takes them)
LenientKnobs = create_model("LenientKnobs", __base__=Lenient, **{
    k.name: (k.kind | None, None) for k in SAMPLING})


class MessagesRequest(LenientKnobs):
    """Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens)."""

    model: str | None = None
    messages: Annotated[list[AnthropicMessage], at_most(MAX_MESSAGES),
                        parts_at_most(MAX_PARTS)]
    system: str | Annotated[list[TextBlock], at_most(MAX_PARTS)] | None = None
    max_tokens: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    tools: Annotated[list[AnthropicTool], at_most(MAX_TOOLS)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None
    metadata: Metadata | None = None


class InputText(Lenient):
    type: Literal["input_text", "output_text", "text"]
    text: str


class Refusal(Lenient):
    type: Literal["refusal"]
    refusal: str


class InputMedia(Lenient):
    type: Literal["input_image", "input_file", "input_audio"]


ResponsePart = tagged({"input_text": InputText, "output_text": InputText, "text": InputText,
                       "refusal": Refusal, "input_image": InputMedia,
                       "input_file": InputMedia, "input_audio": InputMedia}, Other)


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ResponsePart]


class FunctionCallItem(Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutput(Lenient):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ResponsePart]


class ReasoningText(Lenient):
    type: str
    text: str


class ReasoningItem(Lenient):
    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None


InputItem = tagged({"message": MessageItem, "function_call": FunctionCallItem,
                    "function_call_output": FunctionCallOutput, "reasoning": ReasoningItem},
                   Other, default="message")


class ResponsesTool(Lenient):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: Obj | None = None


class ResponsesToolChoice(Lenient):
    type: str
    name: str | None = None


class TextFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: Obj | None = Field(default=None, alias="schema")


class ResponsesText(Lenient):
    format: TextFormat | None = None


class ResponsesReasoning(Lenient):
    effort: str | None = None


class ResponsesRequest(LenientKnobs):
    """OpenAI's Responses API (/v1/responses, /v1/responses/input_tokens)."""

    model: str | None = None
    input: str | Annotated[list[InputItem], at_most(MAX_MESSAGES), parts_at_most(MAX_PARTS)]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: Annotated[list[ResponsesTool], at_most(MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesText | None = None
    reasoning: ResponsesReasoning | None = None
    max_output_tokens: int | None = None
    stream: bool | None = None
    metadata: Metadata | None = None
    # llama-server's telemetry in the stream
    timings_per_token: bool | None = None
    return_progress: bool | None = None
