"""The engine: requests, the scheduler (chunked prefill interleaved with batched decode), prefix reuse, warmup.

Each step runs at most one prefill chunk (for the oldest request still reading its prompt) and one decode
step for every request that is generating. A request owns a state slot from admission to finish; on
admission it restores the longest cached snapshot that is a prefix of its prompt (under its cache salt), and it
leaves snapshots at its prompt boundary and at its end. The engine sees token ids and logits, never layer math.

Structured output: a request may carry a grammar matcher (structured.py). Each decode step fills the token masks of
the constrained rows at once and applies them to copies of those rows only, so unconstrained rows are sampled from
the model's logits bit for bit, and the logits kept for snapshots are never masked.

Several choices of one prompt (n > 1) are queued together: the first prefills, and the others wait until its
prompt snapshot is cached, then start from it, so the prompt is computed once.

Failures: whatever happens to one request after the model's forward (masking, sampling, detokenizing, stop
strings, its snapshots) fails that request alone, with finish_reason "error", and frees its slot; the others go on
untouched. A failure inside the forward itself propagates: the model updates every row's recurrent state in place,
so a half-done batch cannot be undone for the rows that were fine, and the caller must treat the model as broken.
"""
from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Sequence

import torch

from .prefix_cache import PrefixCache
from .runner import ModelFailure, ModelRunner
from .sampling import Sampler, SamplingParams, StopStrings, TokenLogprob, token_logprobs
from .structured import (Constraint, ConstraintFailed, GrammarCompiler, GrammarMatcher, allocate_bitmask,
                         apply_bitmask_, fill_bitmasks)
from .tokenizer import IncrementalDecoder, Tokenizer


class Status(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


class RequestError(ValueError):
    """A request the engine refuses; nothing was changed. `param` names the request field at fault, if one is."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    sampler: Sampler
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: int | None = None
    computed: int = 0                 # tokens whose effect is in the slot's state
    num_cached_tokens: int = 0
    cache_salt: str | None = None     # reuses only prefixes cached under the same salt
    finish_reason: str | None = None  # "stop", "length", "abort", or "error" (then `error` says why)
    error: str | None = None
    error_param: str | None = None    # the request field at fault, when the error is its own input's (its constraint)
    text: str = ""                    # emitted text (stop strings excluded)
    decoder: IncrementalDecoder | None = None
    stops: StopStrings | None = None
    pending: str = ""                 # decoded text held back while it may still become a stop string
    grammar: GrammarMatcher | None = None          # structured output: the tokens allowed next
    logprobs: list[TokenLogprob] = field(default_factory=list)             # of each output token, if asked
    prompt_logprobs: list[TokenLogprob | None] | None = None               # of each prompt token, if asked
    followers: list["Request"] = field(default_factory=list)               # other choices waiting for its prefill
    last_logits: torch.Tensor | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    prefill_done_at: float | None = None
    finished_at: float | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class Update:
    """What one step produced for one request."""
    request: Request
    token_ids: list[int]
    text: str
    finished: bool
    logprobs: list[TokenLogprob] = field(default_factory=list)           # of token_ids, if the request asked
    time: float = field(default_factory=time.perf_counter)    # when the engine produced it


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer | None, max_model_len: int,
                 max_num_seqs: int = 8, prefill_tokens: int = 512, prefix_cache_bytes: int = 1 << 30,
                 batch_invariant: bool = False):
        """`runner` must hold `max_num_seqs` state slots of `max_model_len` tokens. `batch_invariant`: decode one
        sequence per forward, so a sequence's logits never depend on what else is running (matmul kernels pick
        their blocking, and so their reduction order, by batch size); prefill already runs one sequence at a time.
        A prefix-cache hit still starts the prefill's chunks at the snapshot, which can change rounding: for bitwise
        reproducibility give runs distinct cache salts (or no prefix cache). `prefill_tokens`: the most prompt tokens
        a step prefills (a decode step waits for them); 512, llama.cpp's micro-batch, gives each expert's products
        twice the rows 256 did (bench-s and bench-m prefill 4-15% faster)."""
        self.runner, self.cfg, self.tokenizer = runner, runner.cfg, tokenizer
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.batch_invariant = batch_invariant
        chunk = runner.chunk_size
        self.prefill_tokens = max(chunk, prefill_tokens // chunk * chunk)   # whole delta-rule chunks per step
        self.device = runner.device
        self.cache = PrefixCache(prefix_cache_bytes, on_drop=runner.release)
        self.eos_ids = set(tokenizer.eos_token_ids if tokenizer else self.cfg.eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._aborts: set[str] = set()
        self._lock = threading.RLock()                # add_request / abort may come from other threads
        self._ids = itertools.count()
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._bitmask: torch.Tensor | None = None     # the constrained rows' token masks, reused every step
        self.prefix_cache_queries = self.prefix_cache_hits = 0      # prompt tokens looked up / found (vLLM's)

    # ---- requests ----------------------------------------------------------------------------------------
    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                    cache_salt: str | None = None, grammar: GrammarMatcher | None = None) -> Request:
        """Queue a request. Raises RequestError, changing nothing, if it cannot be served."""
        return self.add_requests(prompt, [params], [request_id], cache_salt, [grammar])[0]

    def add_requests(self, prompt: list[int], params: Sequence[SamplingParams],
                     request_ids: Sequence[str | None] | None = None, cache_salt: str | None = None,
                     grammars: Sequence[GrammarMatcher | None] | None = None) -> list[Request]:
        """Queue several choices of one prompt (n > 1): the first prefills it; the others start from its cached
        snapshot once it is there. Raises RequestError, changing nothing, if any cannot be served."""
        return self.queue(self.make_requests(prompt, params, request_ids, cache_salt, grammars))

    def make_requests(self, prompt: list[int], params: Sequence[SamplingParams],
                      request_ids: Sequence[str | None] | None = None, cache_salt: str | None = None,
                      grammars: Sequence[GrammarMatcher | None] | None = None) -> list[Request]:
        """The requests of add_requests, checked but not queued (RequestError if any cannot be served)."""
        vocab = self.cfg.vocab_size
        if not prompt:
            raise RequestError("the prompt is empty")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise RequestError(f"prompt token ids must be integers in [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(prompt)} tokens, but the context is {self.max_model_len}")
        room = self.max_model_len - len(prompt)
        requests = []
        for i, p in enumerate(params):
            if p.max_tokens is not None and p.max_tokens > room:
                raise RequestError(f"the prompt has {len(prompt)} tokens and max_tokens is {p.max_tokens}: "
                                   f"together {len(prompt) + p.max_tokens}, more than the context of "
                                   f"{self.max_model_len} tokens")
            for name, ids in (("logit_bias", p.logit_bias), ("stop_token_ids", p.stop_token_ids)):
                if any(not 0 <= t < vocab for t in ids):
                    raise RequestError(f"'{name}': token ids must lie in [0, {vocab})", param=name)
            request_id = request_ids[i] if request_ids and request_ids[i] else f"req-{next(self._ids)}"
            r = Request(request_id, list(prompt), p, p.max_tokens or room, Sampler(p, self.device, prompt),
                        cache_salt=cache_salt, grammar=grammars[i] if grammars else None)
            if self.tokenizer is not None:
                r.decoder = IncrementalDecoder(self.tokenizer, p.skip_special_tokens)
                r.stops = StopStrings(p.stop, p.include_stop_str_in_output)
            requests.append(r)
        return requests

    def queue(self, choices: list[Request]) -> list[Request]:
        """Queue the choices of one prompt (from make_requests): the first prefills; the others follow it."""
        choices[0].followers = choices[1:]
        with self._lock:
            self.waiting.append(choices[0])
        return choices

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step and free its slot (a client went away)."""
        with self._lock:
            self._aborts.add(request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured-output constraints for this model's tokenizer (built once: it reads the vocabulary)."""
        with self._compiler_lock:
            if self._compiler is None:
                if self.tokenizer is None:
                    raise RequestError("structured output needs the checkpoint's tokenizer")
                self._compiler = GrammarCompiler(self.tokenizer, self.cfg.vocab_size, sorted(self.eos_ids))
            return self._compiler

    # ---- the step ----------------------------------------------------------------------------------------
    def step(self) -> list[Update]:
        updates: list[Update] = []
        self._apply_aborts(updates)
        self._admit(updates)
        prefilling = next((r for r in self.running if r.status == Status.PREFILL), None)
        if prefilling is not None:
            self._prefill_chunk(prefilling, updates)
        decoding = [r for r in self.running if r.status == Status.DECODE]
        if decoding:
            self._decode(decoding, updates)
        return updates

    def _apply_aborts(self, updates: list[Update]) -> None:
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            for leader in [*self.waiting, *self.running]:          # choices still waiting for their first's prefill
                for r in [r for r in leader.followers if r.id in aborts]:
                    leader.followers.remove(r)
                    r.status, r.finish_reason = Status.FINISHED, "abort"
                    updates.append(Update(r, [], "", True))
            for r in [r for r in self.waiting if r.id in aborts]:
                self.waiting.remove(r)
                self._release_followers(r)
                r.status, r.finish_reason = Status.FINISHED, "abort"
                updates.append(Update(r, [], "", True))
        for r in [r for r in self.running if r.id in aborts]:
            r.finish_reason = "abort"
            self._release(r)
            updates.append(Update(r, [], "", True))

    def _admit(self, updates: list[Update]) -> None:
        while self.free_slots:
            with self._lock:
                if not self.waiting:
                    return
                r = self.waiting.popleft()
            r.slot = self.free_slots.pop()
            self.running.append(r)
            self._isolated(r, updates, self._start, r, updates)

    def _start(self, r: Request, updates: list[Update]) -> None:
        # prompt log-probabilities are scored chunk by chunk as the prompt is prefilled, so such a request starts
        # from scratch (as in vLLM): a snapshot keeps only its last position's logits
        scored = r.params.prompt_logprobs is not None
        snap = None if scored else self.cache.match(r.prompt, salt=r.cache_salt)
        if not scored:
            self.prefix_cache_queries += len(r.prompt)
            self.prefix_cache_hits += snap.length if snap is not None else 0
        if snap is None:
            self.runner.reset(r.slot)
            r.status = Status.PREFILL
            r.prompt_logprobs = [None] if scored else None          # the first token has no context
            return
        self.runner.restore(r.slot, snap)
        r.computed = r.num_cached_tokens = snap.length
        if snap.length < len(r.prompt):
            r.status = Status.PREFILL
        else:                                            # the whole prompt was seen before: sample directly
            r.status, r.prefill_done_at = Status.DECODE, time.perf_counter()
            self._release_followers(r)
            self._accept(r, snap.logits, updates)

    def _prefill_chunk(self, r: Request, updates: list[Update]) -> None:
        chunk, start = r.prompt[r.computed:r.computed + self.prefill_tokens], r.computed
        scored = r.prompt_logprobs is not None
        logits = self.runner.forward([chunk], [r.slot], [start], last_only=not scored)[0]
        r.computed += len(chunk)
        if scored:
            self._isolated(r, updates, self._score_chunk, r, logits, start)
            if r.finish_reason is not None:             # scoring failed: the request failed alone
                return
            logits = logits[-1]
        if r.computed == len(r.prompt):
            self._isolated(r, updates, self._end_prefill, r, logits, updates)

    def _score_chunk(self, r: Request, logits: torch.Tensor, start: int) -> None:
        """Each position's logits score the next prompt token."""
        following = r.prompt[start + 1:start + 1 + len(logits)]
        if following:
            r.prompt_logprobs += token_logprobs(logits[:len(following)], following, r.params.prompt_logprobs)

    def _end_prefill(self, r: Request, logits: torch.Tensor, updates: list[Update]) -> None:
        self.cache.insert(r.prompt, self.runner.snapshot(r.slot, r.computed, logits), salt=r.cache_salt)
        r.status, r.prefill_done_at = Status.DECODE, time.perf_counter()
        self._release_followers(r)
        self._accept(r, logits, updates)

    def _release_followers(self, r: Request) -> None:
        """The other choices of r's prompt may start: from its snapshot if it is cached, else on their own."""
        if r.followers:
            with self._lock:
                self.waiting.extendleft(reversed(r.followers))
            r.followers = []

    def _decode(self, batch: list[Request], updates: list[Update]) -> None:
        if self.batch_invariant:
            logits = torch.cat([self.runner.forward([[r.output[-1]]], [r.slot], [r.computed]) for r in batch])
        else:
            logits = self.runner.forward([[r.output[-1]] for r in batch], [r.slot for r in batch],
                                         [r.computed for r in batch])
        masked = self._masked_rows(batch, logits)
        for i, (r, row) in enumerate(zip(batch, logits)):
            r.computed += 1
            r.last_logits = row
            self._isolated(r, updates, self._accept, r, row, updates, masked.get(i))

    def _masked_rows(self, batch: list[Request], logits: torch.Tensor) -> dict[int, torch.Tensor]:
        """{row: a masked copy of it} for the rows whose request has an active grammar: all their masks filled at
        once (on llguidance's threads), then applied to copies. If that fails, each such request masks its own row
        in _accept, where a failure is its own."""
        rows = [i for i, r in enumerate(batch) if r.grammar is not None and r.grammar.constrains]
        if not rows:
            return {}
        try:
            masked = self._mask([batch[i].grammar for i in rows], logits[rows])
        except Exception:  # noqa: BLE001 - retried per request, so that a failure is pinned on its request
            return {}
        return dict(zip(rows, masked))

    def _mask(self, grammars: list[GrammarMatcher], rows: torch.Tensor) -> torch.Tensor:
        """A copy of `rows` [k, vocab] in which row i allows only what grammars[i] allows next."""
        if self._bitmask is None or self._bitmask.shape[0] < len(grammars):
            self._bitmask = allocate_bitmask(max(self.max_num_seqs, len(grammars)), self.cfg.vocab_size)
        fill_bitmasks(grammars, self._bitmask)
        masked = rows.clone()
        apply_bitmask_(masked, self._bitmask, range(len(grammars)))
        return masked

    # ---- failures ----------------------------------------------------------------------------------------
    def _isolated(self, r: Request, updates: list[Update], work: Callable[..., None], *args: object) -> None:
        """Run one request's share of a step; if it fails, fail that request alone."""
        try:
            work(*args)
        except ModelFailure:
            raise                      # not this request's: the model itself cannot go on
        except ConstraintFailed as e:
            r.error_param = e.param
            self._fail(r, updates, str(e))
        except Exception as e:  # noqa: BLE001 - any failure of one request's processing is that request's
            frame = traceback.extract_tb(e.__traceback__)[-1]
            self._fail(r, updates, f"{type(e).__name__}: {e} (at {frame.filename}:{frame.lineno})")

    def _fail(self, r: Request, updates: list[Update], error: str) -> None:
        r.error, r.finish_reason = error, "error"
        if r in self.running:
            self._release(r)
        updates.append(Update(r, [], "", True))

    # ---- outputs -----------------------------------------------------------------------------------------
    def _accept(self, r: Request, logits: torch.Tensor, updates: list[Update],
                masked: torch.Tensor | None = None) -> None:
        """Sample a token from `logits` (`masked`: the same row with the request's grammar mask applied), append
        it, decode text, and decide whether the request is done."""
        if masked is None and r.grammar is not None and r.grammar.constrains:
            masked = self._mask([r.grammar], logits.unsqueeze(0))[0]
        sampled_from = logits if masked is None else masked
        token = r.sampler(sampled_from)
        if r.grammar is not None and not r.grammar.accept(token):
            if not torch.isfinite(sampled_from[token]):          # a token the mask forbade, or NaN logits: ours
                raise RuntimeError(f"token {token} broke the constraint: {r.grammar.error}")
            raise ConstraintFailed(r.grammar.param, f"the constraint failed at output token {len(r.output) + 1}: "
                                                    f"{r.grammar.error}")        # its lexer gave up: the request's
        logprobs = []
        if r.params.logprobs is not None:
            logprobs = token_logprobs(logits[None], [token], r.params.logprobs)
            r.logprobs += logprobs
        if r.first_token_at is None:
            r.first_token_at = time.perf_counter()
        r.output.append(token)
        stop_token = (token in self.eos_ids and not r.params.ignore_eos) or token in r.params.stop_token_ids
        # the grammar is complete (it ends with an end token: ignore_eos cannot make it go on)
        grammar_done = not stop_token and r.grammar is not None and r.grammar.is_finished()
        out_of_room = len(r.output) >= r.max_tokens or len(r.prompt) + len(r.output) >= self.max_model_len
        ends = stop_token or grammar_done or out_of_room
        text, hit_stop = "", False
        if r.decoder is not None:
            if not stop_token and not (grammar_done and token in self.eos_ids):
                r.pending += r.decoder.push(token)
            if ends:
                r.pending += r.decoder.flush()
            text, hit_stop = r.stops.split(r.pending, final=ends)
            r.pending = r.pending[len(text):]
            r.text += text
        if stop_token or hit_stop or grammar_done:
            r.finish_reason = "stop"
        elif out_of_room:
            r.finish_reason = "length"
        if r.finish_reason is not None:
            self._finish(r)
        updates.append(Update(r, [token], text, r.finish_reason is not None, logprobs))

    def _finish(self, r: Request) -> None:
        # The last sampled token was never fed; the state holds tokens[:computed]. Keep it for continuations.
        if r.computed > len(r.prompt):
            self.cache.insert(r.tokens[:r.computed], self.runner.snapshot(r.slot, r.computed, r.last_logits),
                              salt=r.cache_salt)
        self._release(r)

    def _release(self, r: Request) -> None:
        r.status, r.finished_at = Status.FINISHED, time.perf_counter()
        self.running.remove(r)
        self.free_slots.append(r.slot)
        self._release_followers(r)

    # ---- helpers -----------------------------------------------------------------------------------------
    def run(self, requests: list[Request]) -> None:
        """Step until all of `requests` have finished."""
        while any(r.status != Status.FINISHED for r in requests):
            self.step()

    def _run_warmup(self, requests: list[Request]) -> None:
        """run() warmup's requests; ModelFailure if one fails, as the same request from a client would (NaN
        weights: every sampled request), so that a server never turns healthy on a model that cannot serve."""
        self.run(requests)
        failed = next((r for r in requests if r.finish_reason == "error"), None)
        if failed is not None:
            raise ModelFailure(f"a warmup request failed, as clients' would: {failed.error}")

    def warmup(self) -> None:
        """Capture the runner's CUDA graphs, then run every path a request can take (prefill chunks at position 0
        and later, a prompt tail, decode at every batch size up to max_num_seqs, greedy and sampled, snapshot and
        full and partial restore; penalties, logit bias, min-p, log-probabilities of output and prompt; a
        grammar-constrained request beside a free one, with the grammar compiler built), then forget the warmup's
        cache entries. A context too short for some of these runs what fits."""
        self.runner.warm()
        n = min(2 * self.prefill_tokens + 3, self.max_model_len - 4)     # room for 2 more tokens and 2 outputs
        prompt = [i % self.cfg.vocab_size for i in range(1, n + 1)]
        greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        sampled = SamplingParams(max_tokens=2, temperature=0.8, top_p=0.9, top_k=20, seed=0, ignore_eos=True)
        if prompt:
            self._run_warmup([self.add_request(prompt, greedy), self.add_request(prompt, sampled)])  # then a hit
            self._run_warmup([self.add_request(prompt + [1, 2], greedy)])                        # partial restore
        many = SamplingParams(max_tokens=min(self.max_num_seqs + 2, self.max_model_len - 1), temperature=0.0,
                              ignore_eos=True)
        self._run_warmup([self.add_request([i % self.cfg.vocab_size + 1], many) for i in range(self.max_num_seqs)])
        short = min(3, self.max_model_len - 1)
        processed = SamplingParams(max_tokens=short, temperature=0.8, min_p=0.05, presence_penalty=0.5,
                                   frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={1: 1.0}, logprobs=2,
                                   prompt_logprobs=2, seed=0, ignore_eos=True)
        requests = [self.add_request([1, 2], processed)]
        if self.tokenizer is not None:
            grammar = self.grammar_compiler.compile(Constraint("json", {"type": "object"}, "warmup"))
            requests.append(self.add_request([3, 4], SamplingParams(max_tokens=short, temperature=0.0),
                                             grammar=grammar))
        self._run_warmup(requests)
        self.cache.clear()
