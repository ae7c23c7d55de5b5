"""Structured output: a request's constraint (OpenAI `response_format` json_object / json_schema; vLLM's
`structured_outputs` json / regex / choice / grammar and the older `guided_*` names) compiled by llguidance into a
per-request matcher, whose token mask is applied to that request's row of the batched logits only.

llguidance was chosen by measurement (benchmarks/grammar_engines.py, Kimi's 163,840-token vocabulary, ranges over
runs on a busy 2-core machine): a 20-field schema compiles in 1.4-6.4 ms (xgrammar 46-121 ms, outlines-core 1.1-46
s); a mask takes 18-32 us per token on average with free strings and 0.3-0.5 ms with maxLength-bounded strings
(xgrammar 32-80 us and 73-174 us); it installs 7.5 MiB with no dependencies (xgrammar needs triton, a 273 MiB
wheel, and rejects escaped quotes in strings that have a maxLength).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Sequence

import llguidance
import llguidance.tiktoken
import numpy as np
import torch

from .tool_parser import ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

# JSON whitespace is free but bounded, so a model cannot loop on newlines forever; 32 characters still allow a
# newline and 15 levels of two-space indentation. A schema's own "x-guidance" options override this.
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,32}"}
# A constraint's first token mask may take this long (most take well under a millisecond; a 100,000-character
# regex repetition 80 ms); one that takes longer is refused, as each of its masks would hold up every request.
FIRST_MASK_SECONDS = 0.5
STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class StructuredOutputError(ValueError):
    """A constraint that cannot be used; `param` names the request field (the server answers 400)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"'{param}': {message}")
        self.param = param


@dataclass(frozen=True)
class Constraint:
    kind: str            # json | regex | choice | grammar | lark
    value: Any           # a JSON schema (dict), a regex, a list of strings, a Lark or GBNF grammar
    param: str           # the request field it came from, for error messages


# Kimi's tool-call markers as it is trained to write them, special tokens of its tokenizer
KIMI_TOOL_MARKERS = (SECTION_BEGIN[0], SECTION_END[0], CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)


def tool_call_constraint(tools: Sequence[dict[str, Any]], name: str | None, tokenizer: Tokenizer) -> Constraint:
    """tool_choice "required" (`name` None: one or more calls of any of `tools`) or a named function (exactly one
    call of it), as Kimi writes calls: a section of `<|tool_call_begin|>functions.NAME:IDX
    <|tool_call_argument_begin|>{arguments}<|tool_call_end|>`, the arguments valid under the function's
    `parameters` schema, then the end of the output."""
    missing = [m for m in KIMI_TOOL_MARKERS if tokenizer.token_id(m) is None]
    if missing:
        raise StructuredOutputError("tool_choice", f"this model's tokenizer lacks Kimi's tool-call token {missing[0]}")
    section_begin, section_end, call_begin, argument_begin, call_end = KIMI_TOOL_MARKERS
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    rules = [f"start: {section_begin} call{'' if name else '+'} {section_end}",
             "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, f in enumerate(functions):
        schema = {"x-guidance": JSON_OPTIONS, **(f.get("parameters") or {"type": "object"})}
        rules += [f"call_{i}: {call_begin} {json.dumps('functions.' + f['name'] + ':')} /[0-9]{{1,3}}/ "
                  f"{argument_begin} arguments_{i} {call_end}",
                  f"arguments_{i}: %json {json.dumps(schema)}"]
    return Constraint("lark", "\n".join(rules), "tool_choice")


def constraint_from_request(body: dict[str, Any]) -> Constraint | None:
    """The one constraint a request body asks for, or None. Raises StructuredOutputError for a malformed field,
    an unsupported option, or more than one constraint."""
    found = [c for c in (_response_format(body.get("response_format")),
                         *_structured_outputs(body.get("structured_outputs")),
                         *(_constraint(kind, body[key], key) for key, kind in GUIDED_KEYS.items()
                           if body.get(key) is not None)) if c is not None]
    if len(found) > 1:
        raise StructuredOutputError(found[1].param, f"only one constraint per request; '{found[0].param}' is set too")
    return found[0] if found else None


def _response_format(fmt: Any) -> Constraint | None:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json", {"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise StructuredOutputError("response_format.json_schema", 'must be {"name": ..., "schema": {...}}')
        return Constraint("json", spec["schema"], "response_format.json_schema.schema")
    raise StructuredOutputError("response_format", 'type must be "text", "json_object" or "json_schema"')


def _structured_outputs(spec: Any) -> list[Constraint]:
    if spec is None:
        return []
    if not isinstance(spec, dict):
        raise StructuredOutputError("structured_outputs", "must be an object")
    unsupported = sorted(k for k, v in spec.items() if k not in STRUCTURED_OUTPUTS_KEYS and v is not None)
    if unsupported:
        raise StructuredOutputError(f"structured_outputs.{unsupported[0]}",
                                    f"not supported (supported: {', '.join(STRUCTURED_OUTPUTS_KEYS)})")
    out = [_constraint(k, v, f"structured_outputs.{k}") for k, v in spec.items()
           if k != "json_object" and v is not None]
    if spec.get("json_object"):
        out.append(Constraint("json", {"type": "object"}, "structured_outputs.json_object"))
    return out


def _constraint(kind: str, value: Any, param: str) -> Constraint:
    if kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise StructuredOutputError(param, f"not valid JSON: {e}") from None
    ok = {"json": isinstance(value, dict), "regex": isinstance(value, str) and value != "",
          "grammar": isinstance(value, str) and value.strip() != "",
          "choice": isinstance(value, list) and value != [] and all(isinstance(c, str) for c in value)}[kind]
    if not ok:
        raise StructuredOutputError(param, {"json": "must be a JSON schema object", "regex": "must be a regex string",
                                            "grammar": "must be a Lark or GBNF grammar string",
                                            "choice": "must be a non-empty list of strings"}[kind])
    return Constraint(kind, value, param)


class ConstraintFailed(RuntimeError):
    """A request's constraint broke down mid-output (its lexer's limits, a token it refused): the request's own
    input is at fault, and `param` names its field (the server answers 400)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class GrammarMatcher:
    """One request's position in its grammar: the mask of the tokens that may come next, and the tokens taken.
    With `after` (e.g. the ids of `</think>` when the prompt opened reasoning), the grammar applies only once the
    output has ended with those ids; before, every token is allowed but those in `banned_before`."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, after: Sequence[int] = (),
                 banned_before: Sequence[int] = (), param: str = ""):
        """`param`: the request field the constraint came from, for errors."""
        self.matcher, self.vocab_size, self.param = matcher, vocab_size, param
        self.after, self.recent, self.banned_before = list(after), [], list(banned_before)

    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same position (for the other choices of a request)."""
        twin = GrammarMatcher(self.matcher.deep_copy(), self.vocab_size, self.after, self.banned_before, self.param)
        twin.recent = list(self.recent)
        return twin

    @property
    def active(self) -> bool:
        return not self.after

    @property
    def constrains(self) -> bool:
        """The next token is restricted: the grammar applies, or some tokens are banned before it does."""
        return self.active or bool(self.banned_before)

    def fill_mask(self, into: torch.Tensor) -> None:
        """Write the allowed-token bitmask (bit i % 32 of word i // 32 set = token i allowed) into `into`, a
        contiguous int32 CPU row of (vocab_size + 31) // 32 words."""
        _check_bitmask(into.view(1, -1), self.vocab_size)
        if self.active:
            self.matcher.unsafe_compute_mask_ptr(into.data_ptr(), into.numel() * 4)
        else:
            self._fill_before(into)

    def _fill_before(self, row: torch.Tensor) -> None:
        row.fill_(-1)
        words = row.numpy().view(np.uint32)
        for t in self.banned_before:
            words[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False (and the matcher stays in error) if the grammar does not allow it."""
        if self.active:
            return self.matcher.consume_token(token_id)
        self.recent = (self.recent + [token_id])[-len(self.after):]
        if self.recent == self.after:
            self.after = []
        return True

    def is_finished(self) -> bool:
        """The grammar is complete: nothing but an end-of-sequence token may follow."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return _error(self.matcher)


class GrammarCompiler:
    """Compiles constraints for one tokenizer. Building it reads the whole vocabulary (~0.5 s for Kimi's 163,840
    tokens), so the server builds one at start; compiling a constraint takes milliseconds."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        """`vocab_size`: the model's logits width (ids the tokenizer lacks are never allowed)."""
        self.vocab_size = vocab_size
        self.tokenizer = _lltokenizer(tokenizer, vocab_size, list(eos_token_ids))

    def compile(self, constraint: Constraint, after: Sequence[int] = (), banned_before: Sequence[int] = ()
                ) -> GrammarMatcher:
        """A fresh matcher at the start of the constraint (which applies once the output ends with the ids `after`,
        see GrammarMatcher); StructuredOutputError naming the problem if the constraint is invalid."""
        grammar = _grammar(constraint)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise StructuredOutputError(constraint.param, messages[0].strip())
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        # The first token's mask, computed here in the request's own thread: a constraint whose lexer is slow over
        # it (regex x{100000} over Kimi's vocabulary: 3 s a mask, within llguidance's limits) is refused now, not
        # met in the engine's steps, where every other request would wait for each of its masks.
        started = time.thread_time()            # this thread's CPU time: not the engine's load on the cores
        matcher.compute_bitmask()
        took = time.thread_time() - started
        if matcher.is_error():              # e.g. a schema that only refers to itself
            raise StructuredOutputError(constraint.param, _error(matcher))
        if took > FIRST_MASK_SECONDS:
            raise StructuredOutputError(constraint.param, f"too complex: the first token's mask took {took:.1f} s "
                                                          f"(at most {FIRST_MASK_SECONDS} s)")
        return GrammarMatcher(matcher, self.vocab_size, after, banned_before, constraint.param)


def _error(matcher: llguidance.LLMatcher) -> str:
    """llguidance's error, its first line (the rest dumps the parser's state), its "no token can extend the output"
    in words."""
    error = matcher.get_error().splitlines()[0] if matcher.get_error() else ""
    return "unsatisfiable: no output can match it from here" if error == "NoExtensionBias" else error


def _grammar(c: Constraint) -> str:
    if c.kind == "json":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(c.value, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise StructuredOutputError(c.param, str(e)) from None
    try:
        return llguidance.grammar_from(c.kind, c.value)
    except ValueError as e:
        raise StructuredOutputError(c.param, str(e)) from None


def _lltokenizer(tokenizer: Tokenizer, vocab_size: int, eos: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of our tokenizer (tiktoken Encoding or HF tokenizers backend)."""
    if hasattr(tokenizer, "_enc"):
        return llguidance.tiktoken.lltokenizer_from_encoding(tokenizer._enc, n_vocab=vocab_size, eos_token=eos)
    return llguidance.LLTokenizer(tokenizer._hf.to_str(), n_vocab=vocab_size, eos_token=eos)


# ---- batched masks -------------------------------------------------------------------------------------------


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A [rows, (vocab_size + 31) // 32] int32 CPU bitmask, all tokens allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


@lru_cache(maxsize=1)
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()


def fill_bitmasks(matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
    """Row i of `bitmask` (from allocate_bitmask) = the mask of matchers[i], computed for all of them at once on
    llguidance's threads."""
    if not matchers:
        return
    _check_bitmask(bitmask, matchers[0].vocab_size, rows=len(matchers))
    active = [(m.matcher, i) for i, m in enumerate(matchers) if m.active]
    for i, m in enumerate(matchers):
        if not m.active:
            m._fill_before(bitmask[i])
    if active:
        _executor().unsafe_compute_mask_ptr(active, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])


def _check_bitmask(bitmask: torch.Tensor, vocab_size: int, rows: int = 1) -> None:
    """llguidance writes through a raw pointer: the memory must be exactly what it expects."""
    if (bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous()
            or bitmask.dim() != 2 or bitmask.shape[0] < rows or bitmask.shape[1] != (vocab_size + 31) // 32):
        raise ValueError(f"bitmask must be a contiguous int32 CPU tensor of shape [>={rows}, "
                         f"{(vocab_size + 31) // 32}], got {bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}")


# [256, 8]: entry (b, j) is 0 if bit j of byte b is set (token allowed), else -inf
BYTE_BIAS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
                     0.0, -np.inf).astype(np.float32)


@lru_cache(maxsize=8)
def _byte_bias(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(BYTE_BIAS).to(device, dtype)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """In place: logits[rows[i]] = -inf where bitmask row i forbids the token. Rows not listed are not touched,
    so requests without a constraint keep their logits bit for bit. The caller must not pass logits that are
    also kept elsewhere (a prefix-cache snapshot): clone those rows first."""
    if not rows:
        return
    # A 0 / -inf bias looked up per byte and added (x + 0.0 == x). On a 163,840-token row this measured ~0.1 ms in
    # numpy, ~0.2 ms with torch on one thread, ~1.8 ms for masked_fill_ with an unpacked mask, and torch's thread
    # pool took 10-30 ms when the cores were busy; so float32 CPU logits take the single-threaded numpy path.
    data = bitmask[:len(rows)].numpy().astype("<i4", copy=False).view(np.uint8)    # bytes, least significant first
    vocab = logits.shape[-1]
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        for i, row in enumerate(rows):
            values = logits[row].numpy()
            np.add(values, np.take(BYTE_BIAS, data[i], axis=0).reshape(-1)[:vocab], out=values)
        return
    table = _byte_bias(logits.device, logits.dtype)
    data = torch.from_numpy(data).to(logits.device, torch.int32, non_blocking=True)
    for i, row in enumerate(rows):
        logits[row].add_(table.index_select(0, data[i]).view(-1)[:vocab])
