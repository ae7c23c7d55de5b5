"""The OpenAI wire format: request bodies as pydantic models in which every field is typed and bounded, and the
error envelope.

Bodies are parsed straight from their bytes by pydantic's JSON parser, which refuses invalid UTF-8, lone surrogates,
numbers with thousands of digits and nesting deeper than 200 levels, so the server and the engine only ever see
values they can serve; FastAPI publishes the same models as the OpenAPI schema. Types are strict: `"5"` is not an
integer and `true` is not a number (but `5.0` is an integer, as JSON Schema has it). Unknown fields are ignored,
except those in NOT_IMPLEMENTED.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse

from .sampling import SEED_RANGE, SamplingParams

INT32 = (1 << 31) - 1
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
MAX_CHOICES = 16          # n, and prompts in one completions request (each prompt gets n choices)
MAX_PROMPTS = 16
MAX_LOGPROBS = 20         # OpenAI's top_logprobs limit

# Fields that change what a request produces and that this server does not implement yet. Each is refused (400
# naming it) unless absent, null, or set to one of the values that mean "off"; never silently ignored. Implementing
# one is declaring it on the request model below and deleting its line here.
# A field that one request kind implements (e.g. `echo` on completions) is still refused on the other.
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "min_tokens": (0,),
    "prompt_logprobs": (),
    "echo": (False,),
    "suffix": ("",),
    "parallel_tool_calls": (True,),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "truncate_prompt_tokens": (),
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "chat_template": (),
    "continue_final_message": (False,),
    "reasoning_effort": (),
    "prediction": (),
    "audio": (),
    "modalities": (["text"],),
}

# What a union field accepts, said once instead of one pydantic error per alternative.
UNION_RULES = {
    "prompt": f"must be a non-empty string, a non-empty list of token ids, or a list of at most {MAX_PROMPTS} of "
              "either",
    "stop": f"must be a string or a list of at most {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_CHARS} characters",
    "content": "must be a string, null, or a list of {\"type\": \"text\", \"text\": ...} parts",
}


class APIError(Exception):
    """An error answered in OpenAI's envelope: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class RequestInvalid(ValueError):
    """A request body that cannot be served; `param` names the field when there is one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    def problems(self) -> list[tuple[str, str]]:
        """(field, what is wrong) for values that are valid alone but not together."""
        return []


def _integral(value: Any) -> Any:
    """5.0 -> 5: JSON Schema (and so the published schema) counts an integral number as an integer."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral)]
Count = Annotated[Int, Field(ge=1, le=INT32)]
TokenId = Annotated[Int, Field(ge=0, le=INT32)]
Name = Annotated[str, Field(max_length=256)]
Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]          # logit_bias keys: token ids as strings


class TextPart(_Strict):
    model_config = ConfigDict(extra="forbid")      # an image or audio part is refused, not dropped
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    name: Name
    arguments: str | dict[str, Any] = Field(description="the arguments as the model generated them (a JSON string)")


class ToolCall(_Strict):
    id: Name = Field(description="as returned, e.g. Kimi's native functions.NAME:IDX; rendered back as sent")
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(_Strict):
    """One chat message; other keys (reasoning_content, ...) reach the chat template as sent."""
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=256)] | None = None
    tool_call_id: Name | None = None


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Strict):
    name: Name | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: exactly one of these."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Request(_Strict):
    model: Name | None = None
    max_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[Int, Field(ge=-1, le=INT32)] | None = Field(None, description="0 or -1: off")
    seed: Annotated[Int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = Field(
        None, description="reuse only prefixes cached by requests with the same salt")
    user: Name | None = None
    n: Annotated[Int, Field(ge=1, le=MAX_CHOICES)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    logit_bias: Annotated[dict[TokenIdKey, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=1024)] | None = (
        Field(None, description="token id -> bias added to its logit"))
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    guided_grammar: str | None = None

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def top_logprobs_count(self) -> int | None:
        """How many alternatives each output token's log-probability comes with; None: no log-probabilities."""
        return None

    def sampling_params(self, defaults: dict[str, Any] | None = None, choice: int = 0) -> SamplingParams:
        """The parameters of choice `choice` (of n): `defaults` (the checkpoint's generation_config) fill what the
        request leaves out; a seeded request gives choice i the seed + i, as vLLM does."""
        defaults = defaults or {}
        given = lambda name, fallback: (getattr(self, name) if getattr(self, name, None) is not None
                                        else defaults.get(name, fallback))
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        seed = None if self.seed is None else (self.seed + choice) % (1 << 64)
        return SamplingParams(
            max_tokens=self.output_limit or defaults.get("max_tokens"), stop=stop,
            stop_token_ids=self.stop_token_ids or [], temperature=given("temperature", 1.0),
            top_p=given("top_p", 1.0), top_k=given("top_k", 0) or 0, seed=seed, ignore_eos=bool(self.ignore_eos),
            min_p=given("min_p", 0.0), repetition_penalty=given("repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            logprobs=self.top_logprobs_count, include_stop_str_in_output=bool(self.include_stop_str_in_output),
            skip_special_tokens=self.skip_special_tokens is not False)

    def constraint_fields(self) -> dict[str, Any]:
        """The structured-output fields as sent (by their wire names), for structured.constraint_from_request."""
        return self.model_dump(by_alias=True, exclude_none=True, include={
            "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
            "guided_grammar"})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1, max_length=4096)]
    max_completion_tokens: Count | None = None
    tools: Annotated[list[Tool], Field(max_length=256)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='"required" and a named function are enforced by constrained decoding')
    logprobs: bool | None = None
    top_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=64)] | None = Field(
        None, description="more variables for the chat template, e.g. {\"thinking\": false}")
    add_generation_prompt: bool | None = None

    @property
    def output_limit(self) -> int | None:
        """OpenAI's newer name wins; both are validated."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def problems(self) -> list[tuple[str, str]]:
        names = [t.function.name for t in self.tools or []]
        choice = self.tool_choice
        out = []
        if self.top_logprobs and not self.logprobs:
            out.append(("top_logprobs", "needs \"logprobs\": true"))
        if choice == "required" and not names:
            out.append(("tool_choice", "\"required\" needs \"tools\""))
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            out.append(("tool_choice.function.name", f"{choice.function.name!r} is not one of the tools "
                                                     f"({', '.join(names) or 'none given'})"))
        return out

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return tool_dicts(self.tools)


class CompletionRequest(_Request):
    prompt: Text | TokenIds | Annotated[list[Text | TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = None

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts: one string, one list of token ids, or a list of either."""
        prompt = self.prompt
        return prompt if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else [prompt]

    @property
    def top_logprobs_count(self) -> int | None:
        return self.logprobs


class TokenizeRequest(_Strict):
    """vLLM's POST /tokenize: a raw prompt, or the fields of a chat request whose prompt ids are wanted."""
    model: Name | None = None
    prompt: str | None = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=4096)] | None = None
    tools: Annotated[list[Tool], Field(max_length=256)] | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=64)] | None = None

    def problems(self) -> list[tuple[str, str]]:
        if (self.prompt is None) == (self.messages is None):
            return [("prompt", "send exactly one of \"prompt\" and \"messages\"")]
        return []

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return tool_dicts(self.tools)


class DetokenizeRequest(_Strict):
    """vLLM's POST /detokenize."""
    model: Name | None = None
    tokens: list[TokenId]


def tool_dicts(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template sees them: the fields as sent."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


Req = TypeVar("Req", bound=_Strict)


def parse(kind: type[Req], body: bytes) -> Req:
    """The request in `body`, or RequestInvalid naming the first problem."""
    try:
        request = kind.model_validate_json(body)
    except ValidationError as e:
        raise RequestInvalid(*_describe(e.errors()[0])) from None
    for param, problem in request.problems():
        raise RequestInvalid(f"'{param}': {problem}", param=param)
    for name, off in NOT_IMPLEMENTED.items():
        value = (request.model_extra or {}).get(name)
        if value is not None and not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in off):
            hint = f" or set it to {json.dumps(off[0])}" if off else ""
            raise RequestInvalid(f"'{name}' is not supported by this server yet: leave it out{hint}", param=name)
    return request


def _describe(error: dict[str, Any]) -> tuple[str, str | None]:
    if error["type"] == "json_invalid":
        return f"the request body is not valid JSON: {error['ctx']['error']}", None
    loc = list(error["loc"])
    tag = next((i for i, p in enumerate(loc) if isinstance(p, str) and _is_union_tag(p)), None)
    if tag is not None:                       # inside one alternative of a union: describe the union instead
        loc = loc[:tag]
    if not loc:
        return "the request body must be a JSON object", None
    param = ".".join(map(str, loc))
    rule = UNION_RULES.get(str(loc[-1])) if tag is not None else None
    if rule is None and error["type"] != "missing":
        rule = f"{error['msg']} (got {json.dumps(error['input'])[:80]})"
    return f"'{param}': {rule or error['msg']}", param


def _is_union_tag(part: str) -> bool:
    """pydantic names each alternative of a union in an error's location: 'str', 'list[int]', 'constrained-str'."""
    return part in ("str", "int", "float", "bool") or not part.isidentifier()
