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

# Fields that change what a request produces and that this server does not implement yet. Each is refused (400
# naming it) unless absent, null, or set to one of the values that mean "off"; never silently ignored. Implementing
# one is declaring it on the request model below and deleting its line here.
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "logit_bias": ({},),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "min_p": (0,),
    "min_tokens": (0,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "prompt_logprobs": (),
    "echo": (False,),
    "suffix": ("",),
    "response_format": ({"type": "text"},),
    "tool_choice": ("auto",),
    "parallel_tool_calls": (True,),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "reasoning_effort": (),
    "prediction": (),
    "audio": (),
    "modalities": (["text"],),
}

# What a union field accepts, said once instead of one pydantic error per alternative.
UNION_RULES = {
    "prompt": "must be a non-empty string or a non-empty list of token ids (one prompt per request)",
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


class TextPart(_Strict):
    model_config = ConfigDict(extra="forbid")      # an image or audio part is refused, not dropped
    type: Literal["text"]
    text: str


class Message(_Strict):
    """One chat message; other keys (name, tool_calls, tool_call_id, ...) reach the chat template as sent."""
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


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

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens

    def sampling_params(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(
            max_tokens=self.output_limit, stop=stop, stop_token_ids=self.stop_token_ids or [],
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, seed=self.seed,
            ignore_eos=bool(self.ignore_eos))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1, max_length=4096)]
    max_completion_tokens: Count | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=256)] | None = None

    @property
    def output_limit(self) -> int | None:
        """OpenAI's newer name wins; both are validated."""
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: Text | TokenIds | Annotated[list[Text | TokenIds], Field(min_length=1, max_length=1)]

    @property
    def single_prompt(self) -> str | list[int]:
        """The prompt, unwrapped from a one-element list."""
        prompt = self.prompt
        return prompt[0] if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else prompt


Req = TypeVar("Req", bound=_Request)


def parse(kind: type[Req], body: bytes) -> Req:
    """The request in `body`, or RequestInvalid naming the first problem."""
    try:
        request = kind.model_validate_json(body)
    except ValidationError as e:
        raise RequestInvalid(*_describe(e.errors()[0])) from None
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
