"""Generation: parity with transformers' greedy generate, exact prefix reuse, batching, sampling, stopping."""
import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.engine import RequestError, Status

from conftest import CONFIGS

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompt(n, seed=0):
    return torch.randint(3, 470, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, dtype="float32", prefill_tokens=64)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generate_equals_transformers(tiny_dirs, name):
    from transformers import KimiLinearForCausalLM
    ids = prompt(170, seed=3)
    ref = KimiLinearForCausalLM.from_pretrained(tiny_dirs[name], dtype=torch.float32).eval()
    expected = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                            min_new_tokens=12)[0, len(ids):].tolist()
    ours = LLM(tiny_dirs[name], dtype="float32", prefill_tokens=64).generate([ids], GREEDY)[0]
    assert ours.token_ids == expected and ours.finish_reason == "length"


def test_continuation_reuses_prefix_and_matches_fresh_run(tiny_dir, llm):
    first = llm.generate([prompt(150)], GREEDY)[0]
    follow_up = prompt(150) + first.token_ids + prompt(20, seed=9)
    reused = llm.generate([follow_up], GREEDY)[0]
    fresh = LLM(tiny_dir, dtype="float32", prefill_tokens=64).generate([follow_up], GREEDY)[0]
    # the end-of-generation snapshot: prompt + all generated tokens but the last, which was never fed
    assert reused.num_cached_tokens == 150 + len(first.token_ids) - 1
    assert fresh.num_cached_tokens == 0
    assert reused.token_ids == fresh.token_ids


def test_prompt_boundary_snapshot_serves_an_edited_reply(llm):
    base = prompt(120, seed=4)
    llm.generate([base], GREEDY)
    edited = base + [5, 6, 7]                        # the reply was re-rendered differently: only the prompt matches
    assert llm.generate([edited], GREEDY)[0].num_cached_tokens == 120


def test_divergent_prompt_never_uses_a_partial_snapshot(tiny_dir, llm):
    base = prompt(140, seed=5)
    llm.generate([base], GREEDY)
    divergent = base[:100] + prompt(60, seed=6)
    out = llm.generate([divergent], GREEDY)[0]
    fresh = LLM(tiny_dir, dtype="float32", prefill_tokens=64).generate([divergent], GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == fresh.token_ids


def test_identical_prompt_is_served_from_the_snapshot_alone(llm):
    ids = prompt(90, seed=7)
    a = llm.generate([ids], GREEDY)[0]
    b = llm.generate([ids], GREEDY)[0]
    assert b.num_cached_tokens == 90 and b.token_ids == a.token_ids


def test_batched_requests_equal_each_alone(tiny_dir):
    prompts = [prompt(130, seed=10), prompt(45, seed=11), prompt(200, seed=12)]
    alone = [LLM(tiny_dir, dtype="float32", prefill_tokens=64).generate([p], GREEDY)[0].token_ids for p in prompts]
    batched = LLM(tiny_dir, dtype="float32", prefill_tokens=64).generate(prompts, GREEDY)
    assert [o.token_ids for o in batched] == alone


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a = llm.generate([prompt(30, seed=13)], params)[0].token_ids
    b = llm.generate([prompt(30, seed=13), prompt(50, seed=14)], params)[0].token_ids
    other = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=99, ignore_eos=True)
    c = llm.generate([prompt(30, seed=13)], other)[0].token_ids
    assert a == b and a != c


def test_finish_reasons(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32")
    ids = prompt(40, seed=15)
    free = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 16
    stop_id = free.token_ids[5]
    by_id = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[stop_id]))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[:free.token_ids.index(stop_id) + 1]
    with_eos = LLM(tiny_dir, dtype="float32", hf_overrides={"eos_token_id": stop_id})
    by_eos = with_eos.generate([ids], SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert by_eos.finish_reason == "stop" and by_eos.token_ids[-1] == stop_id
    stop_text = free.text[4:7]
    by_text = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, stop=[stop_text]))[0]
    assert by_text.finish_reason == "stop" and by_text.text == free.text[:free.text.index(stop_text)]


def test_rejected_requests_change_nothing(llm):
    engine = llm.engine
    with pytest.raises(RequestError, match="the prompt has 4000 tokens and max_tokens is 200: together 4200"):
        engine.add_request([5] * 4000, SamplingParams(max_tokens=200))
    with pytest.raises(RequestError, match="the prompt has 4096 tokens, but the context is 4096"):
        engine.add_request([5] * 4096, SamplingParams())
    with pytest.raises(RequestError, match="integers in"):
        engine.add_request([5, 100000], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    assert not engine.waiting and not engine.running


def test_abort_frees_the_slot(llm):
    engine = llm.engine
    r = engine.add_request(prompt(100, seed=16), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort(r.id)
    engine.step()
    assert r.status == Status.FINISHED and r.finish_reason == "abort"
    assert len(engine.free_slots) == engine.max_num_seqs and not engine.running


def test_warmup_leaves_results_unchanged(tiny_dir):
    ids = prompt(100, seed=17)
    cold = LLM(tiny_dir, dtype="float32").generate([ids], GREEDY)[0]
    warm_llm = LLM(tiny_dir, dtype="float32", warmup=True)
    assert warm_llm.engine.cache.entries == 0 and len(warm_llm.engine.free_slots) == warm_llm.engine.max_num_seqs
    assert warm_llm.engine._compiler is not None             # the grammar path was warmed too
    assert warm_llm.generate([ids], GREEDY)[0].token_ids == cold.token_ids


def _raise(*args, **kwargs):
    raise RuntimeError("injected failure")


@pytest.fixture
def one_torch_thread():
    """Speed only: B=1 decode steps are dominated by thread hand-offs on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("site", ["sampler", "decoder", "stops"])
def test_a_failure_in_one_requests_processing_fails_it_alone(tiny_dir, site, one_torch_thread):
    """Sampling, detokenizing and stop strings run per request after the forward: a failure there ends that request
    with finish_reason "error" and frees its slot; the requests batched with it go on exactly as alone."""
    llm = LLM(tiny_dir, dtype="float32", prefill_tokens=64)
    prompts = [prompt(40, seed=20 + i) for i in range(3)]
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    llm.engine.cache.clear()
    engine = llm.engine
    good = [engine.add_request(p, GREEDY) for p in prompts]
    bad = engine.add_request(prompt(40, seed=30), GREEDY)
    real = {"sampler": bad.sampler, "decoder": bad.decoder.push, "stops": bad.stops.split}[site]
    calls = [0]

    def flaky(*args, **kwargs):             # fails on its 4th call: mid-decode, after the prefill's first token
        calls[0] += 1
        return _raise() if calls[0] == 4 else real(*args, **kwargs)
    if site == "sampler":
        bad.sampler = flaky
    else:
        setattr(getattr(bad, site), {"decoder": "push", "stops": "split"}[site], flaky)
    engine.run(good + [bad])
    assert bad.finish_reason == "error" and "RuntimeError: injected failure" in bad.error
    assert 0 < len(bad.output) < GREEDY.max_tokens
    assert [r.output for r in good] == alone
    assert not engine.running and len(engine.free_slots) == engine.max_num_seqs


def test_a_failing_forward_stops_the_engine(tiny_dir):
    """The model updates every row's state in place: a failed forward cannot be undone for the rows that were fine,
    so it propagates to the caller (the server then stops) instead of being pinned on one request."""
    llm = LLM(tiny_dir, dtype="float32")
    llm.runner.forward = _raise
    llm.engine.add_request(prompt(10), GREEDY)
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.engine.step()


def test_warmup_fits_a_tiny_context(tiny_dir):
    """--max-model-len 10 used to fail warmup with 'the prompt is empty'."""
    llm = LLM(tiny_dir, dtype="float32", max_model_len=10, warmup=True)
    out = llm.generate([prompt(4)], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_batch_invariant_bf16_greedy_tokens_equal_each_alone(tiny_dir, one_torch_thread):
    """24 requests through 8 slots decode in batches of every size; in batch-invariant mode each sequence's bf16
    tokens are those it gets alone. (Without the mode this tiny bf16 model already diverges here.)"""
    llm = LLM(tiny_dir, dtype="bfloat16", max_num_seqs=8)
    llm.engine.batch_invariant = True
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [prompt(10 + 5 * i, seed=40 + i) for i in range(24)]
    alone = []
    for p in prompts:
        llm.engine.cache.clear()                         # alone means alone: no prefix from the previous prompt
        alone.append(llm.generate([p], params)[0].token_ids)
    llm.engine.cache.clear()
    assert [o.token_ids for o in llm.generate(prompts, params)] == alone


# ---- the API's sampling features, in the engine ------------------------------------------------------------

def penalized(logits, prompt, output, params):
    """vLLM's formula, written out: logit_bias, then the repetition penalty on prompt and output tokens, then the
    frequency and presence penalties on output tokens."""
    x = logits.double().clone()
    for token, bias in params.logit_bias.items():
        x[token] += bias
    for token in set(prompt) | set(output):
        x[token] = x[token] / params.repetition_penalty if x[token] > 0 else x[token] * params.repetition_penalty
    for token in set(output):
        x[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return x


def test_penalties_and_logit_bias_follow_the_formula_at_every_step(llm, monkeypatch, one_torch_thread):
    """Greedy generation with every penalty: each token is the argmax of the formula applied to the logits the
    engine gave the sampler (recorded), with the history up to that step."""
    from deltaserve.sampling import Sampler
    seen = []
    real = Sampler.__call__
    monkeypatch.setattr(Sampler, "__call__", lambda self, logits: seen.append(logits.clone()) or real(self, logits))
    ids = prompt(30, seed=50)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.4,
                            frequency_penalty=0.6, presence_penalty=0.3, logit_bias={ids[3]: 2.5, 7: -1.0})
    out = llm.generate([ids], params)[0].token_ids
    unpenalized = llm.generate([ids], GREEDY)[0].token_ids
    assert out != unpenalized[:len(out)]                     # the penalties change this generation
    assert len(seen) == 24 + 12
    for step, (logits, token) in enumerate(zip(seen, out)):
        assert token == int(penalized(logits, ids, out[:step], params).argmax())


def test_min_p_drops_tokens_below_its_share_of_the_likeliest():
    from deltaserve.sampling import Sampler
    logits = torch.tensor([3.0, 2.0, 0.0, -1.0, 2.9])
    sampler = Sampler(SamplingParams(temperature=1.0, min_p=0.3, seed=1), prompt=[])
    probs = logits.softmax(-1)
    allowed = {i for i in range(5) if probs[i] >= 0.3 * probs.max()}
    assert allowed == {0, 1, 4} and {sampler(logits) for _ in range(200)} == allowed


def test_logprobs_are_the_log_softmax_of_the_models_logits(llm, one_torch_thread):
    """Output tokens' and prompt tokens' log-probabilities equal log_softmax of LLM.logits at those positions."""
    ids = prompt(60, seed=51)
    r = llm.engine.add_request(ids, SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True,
                                                   logprobs=4, prompt_logprobs=2))
    llm.engine.run([r])
    reference = torch.log_softmax(llm.logits(ids + r.output).double(), -1)
    for position, (token, logprob, top) in enumerate(r.logprobs, start=len(ids) - 1):
        assert token == (ids + r.output)[position + 1] and abs(logprob - reference[position, token]) <= 1e-5
        expected = reference[position].topk(4)
        assert [t for t, _ in top] == expected.indices.tolist()
        assert max(abs(lp - v) for (_, lp), v in zip(top, expected.values.tolist())) <= 1e-5
    assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(ids)
    for position, (token, logprob, top) in enumerate(r.prompt_logprobs[1:]):
        assert token == ids[position + 1] and abs(logprob - reference[position, token]) <= 1e-5 and len(top) == 2


def test_scoring_the_prompt_changes_neither_the_output_nor_the_cache_and_fails_alone(tiny_dir, monkeypatch,
                                                                                   one_torch_thread):
    """A request that asks for prompt log-probabilities (all positions' logits) samples exactly what it would
    without, and leaves the same snapshot logits; a failure while scoring fails that request alone."""
    llm = LLM(tiny_dir, dtype="bfloat16", prefill_tokens=16)
    ids = prompt(40, seed=52)
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = llm.generate([ids], plain)[0].token_ids
    cached = llm.engine.cache.match(ids).logits.clone()
    llm.engine.cache.clear()
    scored = llm.engine.add_request(ids, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                        prompt_logprobs=1))
    llm.engine.run([scored])
    assert scored.output == expected and torch.equal(llm.engine.cache.match(ids).logits, cached)
    monkeypatch.setattr("deltaserve.engine.token_logprobs", lambda *a: _raise())
    bad = llm.engine.add_request(ids, SamplingParams(max_tokens=6, prompt_logprobs=1))
    good = llm.engine.add_request(prompt(30, seed=53), plain)
    llm.engine.run([bad, good])
    assert bad.finish_reason == "error" and "injected failure" in bad.error and len(good.output) == 6
    assert not llm.engine.running and len(llm.engine.free_slots) == llm.engine.max_num_seqs


def test_choices_of_one_prompt_prefill_it_once(llm, one_torch_thread):
    """n > 1: the first choice prefills the prompt; the others start from its cached snapshot."""
    llm.engine.cache.clear()
    ids = prompt(150, seed=52)
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    hits = llm.engine.prefix_cache_hits
    requests = llm.engine.add_requests(ids, params)
    llm.engine.run(requests)
    assert [r.num_cached_tokens for r in requests] == [0, 150, 150]
    assert llm.engine.prefix_cache_hits - hits == 300
    assert len({tuple(r.output) for r in requests}) == 3            # each choice samples with its own seed


def test_aborting_a_waiting_choice_leaves_its_siblings_running(llm, one_torch_thread):
    ids = prompt(80, seed=53)
    requests = llm.engine.add_requests(ids, [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)] * 3)
    llm.engine.abort(requests[1].id)
    llm.engine.run(requests)
    assert [r.finish_reason for r in requests] == ["length", "abort", "length"]
    assert not llm.engine.running and len(llm.engine.free_slots) == llm.engine.max_num_seqs


def test_a_grammar_masks_its_own_row_only_and_never_the_cached_logits(tiny_dir, one_torch_thread):
    """A json_schema request batched with free ones: its output validates, theirs are token for token what they
    are alone, and the snapshots it leaves hold the model's logits, not masked ones."""
    import json

    import jsonschema

    from deltaserve.structured import Constraint
    llm = LLM(tiny_dir, dtype="float32", prefill_tokens=64)
    free = [prompt(40 + 10 * i, seed=60 + i) for i in range(3)]
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in free]
    llm.engine.cache.clear()
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    grammar = llm.engine.grammar_compiler.compile(Constraint("json", schema, "response_format"))
    constrained_prompt = prompt(50, seed=70)
    constrained = llm.engine.add_request(constrained_prompt, SamplingParams(max_tokens=400, temperature=1.0,
                                                                          seed=5), grammar=grammar)
    requests = [llm.engine.add_request(p, GREEDY) for p in free]
    llm.engine.run([constrained, *requests])
    assert [r.output for r in requests] == alone
    assert constrained.finish_reason == "stop"
    jsonschema.validate(json.loads(constrained.text), schema)
    at_prompt = llm.engine.cache.match(constrained_prompt).logits
    at_end = llm.engine.cache.match(constrained.tokens).logits          # masked logits would hold -inf
    llm.engine.cache.clear()
    llm.generate([constrained_prompt], SamplingParams(max_tokens=1, temperature=0.0))
    assert torch.equal(at_prompt, llm.engine.cache.match(constrained_prompt).logits) and at_end.isfinite().all()


def test_stop_strings_can_be_kept_and_special_tokens_shown(llm, one_torch_thread):
    ids = prompt(40, seed=15)
    free = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    stop = free.text[4:7]
    kept = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, stop=[stop],
                                              include_stop_str_in_output=True))[0]
    assert kept.text == free.text[:free.text.index(stop) + len(stop)]
    special = llm.tokenizer.token_id("<|tool_call_begin|>")
    biased = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logit_bias={special: 100.0})
    assert llm.generate([ids], biased)[0].text == ""
    shown = llm.generate([ids], SamplingParams(**{**biased.__dict__, "skip_special_tokens": False}))[0]
    assert shown.text == "<|tool_call_begin|>" * 2


@pytest.mark.parametrize("max_num_seqs", [0, -1])
def test_an_engine_without_slots_is_refused_up_front(tiny_dir, max_num_seqs):
    with pytest.raises(ValueError, match=f"max_num_seqs: {max_num_seqs} must be at least 1"):
        LLM(tiny_dir, max_num_seqs=max_num_seqs)


def test_a_model_whose_warmup_fails_is_refused_before_serving(nan_dir):
    """NaN weights load, but the warmup's sampled request fails, as every sampled request would: the warmup raises
    (the server then exits with that line) instead of turning healthy and failing every request."""
    from deltaserve.runner import ModelFailure
    with pytest.raises(ModelFailure, match="a warmup request failed, as clients' would: .*probability tensor"):
        LLM(nan_dir, warmup=True)
    llm = LLM(nan_dir)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=1.0))[0]
    assert out.finish_reason == "error" and "probability tensor" in out.error      # the Python API says why
    # greedy under a constraint: argmax of NaN logits takes a token the mask forbade; the model's fault, not the
    # request's (no error_param: the server answers 500, not a 400 blaming the constraint)
    from deltaserve.structured import Constraint
    grammar = llm.engine.grammar_compiler.compile(Constraint("json", {"type": "object"}, "guided_json"))
    r = llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0), grammar=grammar)
    llm.engine.run([r])
    assert r.finish_reason == "error" and r.error_param is None and "broke the constraint" in r.error
