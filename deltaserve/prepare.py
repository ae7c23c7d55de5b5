"""From a parsed API request to the engine's work (in a worker thread, off the event loop): the chat template
rendered to token ids (also what POST /tokenize answers), each choice's sampling parameters, structured-output and
tool_choice constraints compiled into one grammar matcher per choice, and how each choice's text is to be read.
Every problem is an APIError (400) naming the field."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .chat import ChatTemplateError
from .choices import ChatOutput
from .engine import RequestError
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, NamedToolChoice
from .sampling import SamplingParams
from .structured import (Constraint, GrammarMatcher, StructuredOutputError, constraint_from_request,
                         tool_call_constraint)
from .tool_parser import SECTION_BEGIN


@dataclass
class Group:
    """One prompt and its n choices."""
    prompt: list[int]
    params: list[SamplingParams]
    grammars: list[GrammarMatcher | None]
    echo: str | None = None             # completions with echo: the prompt's text, which leads each choice's text


@dataclass
class Job:
    request: ChatCompletionRequest | CompletionRequest
    groups: list[Group]
    chat_output: ChatOutput | None = None                    # chat: how the output text is read


def render_chat(llm: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The token ids a chat request prefills: special-token text in messages, tools and kwargs stays plain text."""
    try:
        return llm.template.render_ids(llm.tokenizer, messages, add_generation_prompt, tools, template_kwargs)
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from None


def refuse_if_surely_too_long(llm: Any, text_chars: int, param: str) -> None:
    """A prompt that cannot fit whatever its tokens: refused without spending seconds tokenizing megabytes."""
    fewest = llm.tokenizer.fewest_tokens(text_chars) if llm.tokenizer else 0
    if fewest >= llm.max_model_len:
        raise APIError(400, f"the prompt has at least {fewest} tokens ({text_chars} characters), but the context is "
                            f"{llm.max_model_len}", param=param, code="context_length_exceeded")


def chat_text_chars(messages: list[Any]) -> int:
    return sum(len(m.content) if isinstance(m.content, str) else sum(len(p.text) for p in m.content or [])
               for m in messages)


def prepare_chat(llm: Any, request: ChatCompletionRequest, defaults: dict[str, Any], reasoning: str) -> Job:
    refuse_if_surely_too_long(llm, chat_text_chars(request.messages), "messages")
    messages = [m.model_dump(exclude_none=True) for m in request.messages]
    kwargs = request.chat_template_kwargs or {}
    prompt = render_chat(llm, messages, request.tool_dicts, request.add_generation_prompt is not False, kwargs)
    tools = bool(request.tools) and request.tool_choice != "none"
    tail = llm.tokenizer.decode(prompt[-32:], skip_special_tokens=False)
    output = ChatOutput(reasoning, tail, kwargs, tools, isinstance(request.tool_choice, NamedToolChoice))
    params = choice_params(llm, request, defaults, len(prompt))
    for p in params:
        # markers must reach the tool parser as text (vLLM's Kimi parser does the same)
        p.skip_special_tokens = p.skip_special_tokens and not tools
    answer = output.reasoning_parser().answer_marker
    grammars = compile_constraints(llm, request, _tool_constraint(llm, request), len(params), answer)
    return Job(request, [Group(prompt, params, grammars)], output)


def prepare_completion(llm: Any, request: CompletionRequest, defaults: dict[str, Any]) -> Job:
    """Each prompt is raw: special-token text in it is special."""
    groups = []
    for i, prompt in enumerate(request.prompts):
        if isinstance(prompt, str):
            if llm.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
            refuse_if_surely_too_long(llm, len(prompt), "prompt")
            ids = llm.encode(prompt)
        else:
            ids = list(prompt)
        params = choice_params(llm, request, defaults, len(ids))
        echo = None
        if request.echo:
            echo = (prompt if isinstance(prompt, str) else
                    llm.tokenizer.decode(ids, skip_special_tokens=False) if llm.tokenizer else "")
            if request.logprobs is not None:
                params[0].prompt_logprobs = request.logprobs        # scored once; every choice shows the same
        groups.append(Group(ids, params, compile_constraints(llm, request, None, len(params), None), echo))
    return Job(request, groups)


def choice_params(llm: Any, request: ChatCompletionRequest | CompletionRequest, defaults: dict[str, Any],
                  prompt_tokens: int) -> list[SamplingParams]:
    """Each choice's sampling parameters. A default max_tokens (generation_config's max_new_tokens) is capped by
    the room the prompt leaves, as vLLM does: only a max_tokens the client sent can make a request too long."""
    params = [request.sampling_params(defaults, i) for i in range(request.choices)]
    if request.output_limit is None and defaults.get("max_tokens") is not None:
        for p in params:
            p.max_tokens = max(1, min(p.max_tokens, llm.max_model_len - prompt_tokens))
    return params


def _tool_constraint(llm: Any, request: ChatCompletionRequest) -> Constraint | None:
    choice = request.tool_choice
    if choice != "required" and not isinstance(choice, NamedToolChoice):
        return None
    name = choice.function.name if isinstance(choice, NamedToolChoice) else None
    try:
        return tool_call_constraint(request.tool_dicts, name, llm.tokenizer)
    except StructuredOutputError as e:
        raise APIError(400, str(e), param=e.param) from None


def compile_constraints(llm: Any, request: ChatCompletionRequest | CompletionRequest, tools: Constraint | None,
                        n: int, answer_marker: str | None) -> list[GrammarMatcher | None]:
    """One matcher per choice for the request's constraint (None each when it has none), compiled once. With
    `answer_marker` (the output starts inside reasoning), the constraint applies once the output has ended with that
    marker; a forced tool call may not open its section inside the reasoning, where the grammar cannot reach it."""
    try:
        constraint = constraint_from_request(request.constraint_fields())
        if constraint is not None and tools is not None:
            raise StructuredOutputError("tool_choice", f"only one constraint per request; '{constraint.param}' is "
                                                       "set too")
        constraint = constraint or tools
        if constraint is None:
            return [None] * n
        tokenizer = llm.tokenizer
        after = tokenizer.encode(answer_marker) if answer_marker else ()
        banned = [tokenizer.token_id(m) for m in SECTION_BEGIN] if after and constraint is tools else []
        first = llm.engine.grammar_compiler.compile(constraint, after, [t for t in banned if t is not None])
        return [first] + [first.copy() for _ in range(n - 1)]
    except StructuredOutputError as e:
        raise APIError(400, str(e), param=e.param) from None
    except RequestError as e:
        raise APIError(400, str(e), param="response_format") from None
