"""Structured output: request fields to constraints, llguidance matchers over the real Kimi tokenizer format, and
masks applied to a batch's constrained rows only. Outputs of a random-logits sampler are checked with jsonschema
and re."""
import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from deltaserve import structured
from deltaserve.structured import (Constraint, GrammarCompiler, StructuredOutputError, allocate_bitmask,
                                   apply_bitmask_, constraint_from_request, fill_bitmasks)
from deltaserve.tiny import write_tokenizer
from deltaserve.tokenizer import Tokenizer

VOCAB = 512
SCHEMAS = {
    "record": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "ok": {"type": "boolean"}, "role": {"enum": ["admin", "user"]},
        "note": {"type": ["string", "null"], "maxLength": 6},
        "scores": {"type": "array", "items": {"type": "integer", "maximum": 99}, "maxItems": 3},
        "where": {"type": "object", "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1}},
                  "required": ["x"], "additionalProperties": False}},
        "required": ["name", "age", "ok", "role", "note", "scores", "where"], "additionalProperties": False},
    "list": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["id"], "additionalProperties": False}},
    "refs": {"$defs": {"pt": {"type": "object", "properties": {"v": {"enum": [1, 2, "three"]}}, "required": ["v"],
                              "additionalProperties": False}},
             "anyOf": [{"$ref": "#/$defs/pt"}, {"type": "string", "pattern": "^[a-c]{2}$"}]},
    "number": {"type": "number", "minimum": 0, "maximum": 10},
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tokenizer files make-tiny writes: Kimi's tiktoken layout, 480 ranks and 32 special ids."""
    root = tmp_path_factory.mktemp("tok")
    write_tokenizer(root, VOCAB)
    return Tokenizer(root)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, [tokenizer.token_id("<|im_end|>")])


def generate(compiler, tokenizer, constraint: Constraint, generator: torch.Generator, max_tokens: int = 400) -> str:
    """Sample from random logits under the constraint's mask until the end token; the decoded text."""
    eos = tokenizer.token_id("<|im_end|>")
    matcher, bitmask, out = compiler.compile(constraint), allocate_bitmask(1, VOCAB), []
    for _ in range(max_tokens):
        logits = torch.randn(1, VOCAB, generator=generator) * 3
        fill_bitmasks([matcher], bitmask)
        apply_bitmask_(logits, bitmask, [0])
        token = int(torch.multinomial(logits[0].softmax(-1), 1, generator=generator))
        assert matcher.accept(token), matcher.error
        if token == eos:
            assert matcher.is_finished()
            return tokenizer.decode(out)
        out.append(token)
    raise AssertionError(f"no end token after {max_tokens} tokens: {tokenizer.decode(out)!r}")


@pytest.mark.parametrize("name", SCHEMAS)
def test_random_sampling_under_a_schema_always_validates(compiler, tokenizer, name):
    generator = torch.Generator().manual_seed(len(name))
    for _ in range(5):          # 4 schemas x 5 runs = 20 generations
        text = generate(compiler, tokenizer, Constraint("json", SCHEMAS[name], "x"), generator)
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_regex_choice_and_grammar_outputs_match(compiler, tokenizer):
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        assert re.fullmatch(r"\d{3}-[a-z]{2,4}", generate(compiler, tokenizer, Constraint("regex", r"\d{3}-[a-z]{2,4}",
                                                                                        "x"), generator))
        assert generate(compiler, tokenizer, Constraint("choice", ["red", "green", "<b>"], "x"), generator) in {
            "red", "green", "<b>"}
        gbnf = 'root ::= ("a" | "b") ("a" | "b")? "."'
        assert re.fullmatch(r"[ab]{1,2}\.", generate(compiler, tokenizer, Constraint("grammar", gbnf, "x"), generator))
        lark = 'start: "x=" NUM\nNUM: /[0-9]{1,3}/'
        assert re.fullmatch(r"x=[0-9]{1,3}", generate(compiler, tokenizer, Constraint("grammar", lark, "x"), generator))


def test_json_object_accepts_any_object_and_nothing_else(compiler, tokenizer):
    constraint = constraint_from_request({"response_format": {"type": "json_object"}})
    matcher = compiler.compile(constraint)
    for token in tokenizer.encode('{"a": [1, {"b": null}], "c": "d"}'):
        assert matcher.accept(token)
    assert matcher.accept(tokenizer.token_id("<|im_end|>")) and matcher.is_finished()
    assert not compiler.compile(constraint).accept(tokenizer.encode("[")[0])


def test_json_whitespace_is_free_but_bounded(compiler, tokenizer):
    """Pretty-printed JSON is accepted, but a model cannot loop on whitespace: at most 32 characters in one place."""
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}}
    matcher = compiler.compile(Constraint("json", schema, "x"))
    assert all(matcher.accept(t) for t in tokenizer.encode(json.dumps({"a": [1, 2]}, indent=2)))
    assert matcher.accept(tokenizer.token_id("<|im_end|>"))
    matcher, space = compiler.compile(Constraint("json", schema, "x")), tokenizer.encode(" ")
    assert len(space) == 1 and matcher.accept(tokenizer.encode("{")[0])
    assert all(matcher.accept(space[0]) for _ in range(32))
    assert not matcher.accept(space[0])


def test_constraint_after_reasoning_applies_once_the_output_ends_with_the_gate(compiler, tokenizer):
    gate = tokenizer.encode("</think>")
    matcher = compiler.compile(Constraint("choice", ["yes", "no"], "x"), after=gate)
    full = allocate_bitmask(1, VOCAB)
    for token in tokenizer.encode("Hmm, </thin") + gate:
        bitmask = allocate_bitmask(1, VOCAB)
        bitmask.zero_()
        fill_bitmasks([matcher], bitmask)
        assert torch.equal(bitmask, full) and matcher.accept(token) and not matcher.is_finished()
    assert matcher.active and not matcher.accept(tokenizer.encode("maybe")[0])
    matcher = compiler.compile(Constraint("choice", ["yes", "no"], "x"), after=gate)
    assert all(matcher.accept(t) for t in gate + tokenizer.encode("no")) and matcher.is_finished()


def test_banned_tokens_are_masked_until_the_gate_and_copies_are_independent(compiler, tokenizer):
    """A forced tool call after reasoning: the section marker may not open inside the reasoning (banned before the
    gate, bit 31 of a word included); a copy (another choice) advances on its own."""
    gate = tokenizer.encode("</think>")
    banned = [tokenizer.token_id("<|im_end|>"), 31, 63]
    matcher = compiler.compile(Constraint("choice", ["yes", "no"], "x"), after=gate, banned_before=banned)
    assert matcher.constrains and not matcher.active
    bitmask = allocate_bitmask(1, VOCAB)
    fill_bitmasks([matcher], bitmask)
    words = bitmask[0].numpy().view(np.uint32)
    allowed = lambda t: bool(words[t // 32] >> (t % 32) & 1)
    assert not any(allowed(t) for t in banned) and all(allowed(t) for t in gate + [0, 30, 32, 62])
    twin = matcher.copy()
    assert all(matcher.accept(t) for t in gate + tokenizer.encode("no")) and matcher.is_finished()
    assert not twin.active and all(twin.accept(t) for t in gate) and twin.active and not twin.is_finished()
    assert twin.accept(tokenizer.encode("yes")[0])


def test_masking_leaves_unconstrained_rows_bit_identical(compiler, tokenizer):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    matchers = [compiler.compile(Constraint("json", SCHEMAS["record"], "x")),
                compiler.compile(Constraint("regex", r"[0-9]+", "x"))]
    bitmask = allocate_bitmask(2, VOCAB)
    fill_bitmasks(matchers, bitmask)
    apply_bitmask_(logits, bitmask, [1, 3])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    digits = {tokenizer.encode(str(d))[0] for d in range(10)}
    allowed3 = set(torch.nonzero(logits[3] > float("-inf")).flatten().tolist())
    assert digits <= allowed3 and allowed3 <= {t for t in range(VOCAB) if tokenizer.decode([t]).isdigit()}
    assert set(torch.nonzero(logits[1] > float("-inf")).flatten().tolist()) == {tokenizer.encode("{")[0]}
    kept = logits[[1, 3]] > float("-inf")
    assert torch.equal(logits[[1, 3]][kept], before[[1, 3]][kept])
    other = before.to(torch.float64)        # the torch path (other dtypes and devices) masks the same tokens
    apply_bitmask_(other, bitmask, [1, 3])
    assert torch.equal(other.isinf(), logits.isinf()) and torch.equal(other[0], before[0].to(torch.float64))


def test_batched_masks_equal_one_at_a_time(compiler):
    matchers = [compiler.compile(Constraint("json", s, "x")) for s in SCHEMAS.values()]
    batch = allocate_bitmask(len(matchers), VOCAB)
    fill_bitmasks(matchers, batch)
    for i, m in enumerate(matchers):
        row = allocate_bitmask(1, VOCAB)[0]
        m.fill_mask(row)
        assert torch.equal(row, batch[i])
    with pytest.raises(ValueError, match="int32"):
        matchers[0].fill_mask(torch.zeros(VOCAB // 32, dtype=torch.int64))


def test_invalid_constraints_raise_value_errors_naming_field_and_problem(compiler):
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}
    with pytest.raises(StructuredOutputError, match=r"'response_format.json_schema.schema': Invalid type: strin") as e:
        compiler.compile(constraint_from_request(body))
    assert isinstance(e.value, ValueError) and e.value.param == "response_format.json_schema.schema"
    cases = [({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "guided_json", "Unsatisfiable"),
             ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
             ({"guided_grammar": "start: foo"}, "guided_grammar", "unknown name"),
             ({"guided_json": {"$ref": "#/$defs/missing"}}, "guided_json", "does not exist"),
             ({"guided_json": {"$ref": "#"}}, "guided_json", "unsatisfiable: no output can match it"),
             ({"guided_grammar": 'start: a\na: a "x"'}, "guided_grammar", "unsatisfiable: no output can match it")]
    for body, param, problem in cases:
        with pytest.raises(StructuredOutputError, match="(?s)" + re.escape(f"'{param}'") + ".*" + problem):
            compiler.compile(constraint_from_request(body))


def test_a_constraint_whose_first_mask_is_slow_is_refused_when_compiled(compiler, monkeypatch):
    """A constraint whose first token mask takes longer than FIRST_MASK_SECONDS is refused when the request
    arrives (a 400), before any engine step would wait for its masks."""
    compiler.compile(constraint_from_request({"guided_regex": "a{1000}"}))
    monkeypatch.setattr(structured, "FIRST_MASK_SECONDS", 0.0)
    with pytest.raises(StructuredOutputError, match=r"'guided_regex': too complex: the first token's mask took"):
        compiler.compile(constraint_from_request({"guided_regex": "a{1000}"}))


def test_request_fields_give_one_constraint():
    schema = {"type": "object"}
    assert constraint_from_request({}) is None
    assert constraint_from_request({"response_format": {"type": "text"}}) is None
    assert constraint_from_request({"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": schema, "strict": True}}}) == Constraint("json", schema,
                                                                        "response_format.json_schema.schema")
    assert constraint_from_request({"structured_outputs": {"json": '{"type": "object"}'}}).value == schema
    assert constraint_from_request({"structured_outputs": {"json_object": True}}).value == schema
    assert constraint_from_request({"guided_choice": ["a", "b"]}) == Constraint("choice", ["a", "b"], "guided_choice")
    assert constraint_from_request({"guided_regex": "x+"}).kind == "regex"
    errors = [({"response_format": {"type": "xml"}}, "'response_format'"),
              ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "json_schema"),
              ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag': not supported"),
              ({"guided_choice": []}, "non-empty list"), ({"guided_json": "{bad"}, "not valid JSON"),
              ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "only one constraint")]
    for body, message in errors:
        with pytest.raises(StructuredOutputError, match=re.escape(message)):
            constraint_from_request(body)


def test_tokenizer_json_checkpoints_are_supported(tmp_path):
    """A checkpoint with tokenizer.json (HF tokenizers) instead of tiktoken.model."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer, hf.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    hf.train_from_iterator(["hello world 12 34"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer(tmp_path)
    compiler = GrammarCompiler(tokenizer, 320, [tokenizer.token_id("<|im_end|>")])
    logits = torch.zeros(1, 320)
    bitmask = allocate_bitmask(1, 320)
    fill_bitmasks([compiler.compile(Constraint("regex", "[0-9]{2}", "x"))], bitmask)
    apply_bitmask_(logits, bitmask, [0])
    allowed = [tokenizer.decode([t]) for t in torch.nonzero(logits[0] == 0).flatten().tolist()]
    assert set(allowed) == {str(d) for d in range(10)} | {"12", "34"}


def test_kimi_sized_vocabulary_never_allows_ids_the_tokenizer_lacks(tmp_path):
    """The bench preset's layout: 163,840 logits, 480 ranks, specials at the top, nothing in between."""
    write_tokenizer(tmp_path, 163840)
    tokenizer = Tokenizer(tmp_path)
    compiler = GrammarCompiler(tokenizer, 163840, [tokenizer.token_id("[EOS]")])
    matcher = compiler.compile(Constraint("json", {"type": "object", "properties": {"s": {"type": "string"}}}, "x"))
    for token in tokenizer.encode('{"s": "'):
        matcher.accept(token)
    logits = torch.zeros(1, 163840)
    bitmask = allocate_bitmask(1, 163840)
    fill_bitmasks([matcher], bitmask)
    apply_bitmask_(logits, bitmask, [0])
    allowed = torch.nonzero(logits[0] == 0).flatten()
    assert len(allowed) > 300 and int(allowed.max()) < 480
