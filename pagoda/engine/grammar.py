"""Structured outputs in the engine: each request's grammar as an llguidance matcher, applied to
its logits as a token bitmask every step it samples.

- `check_structured_outputs` (the client, before a request is queued): the grammar must compile
  (without the tokenizer); ValueError naming the field otherwise.
- `GrammarCompiler` compiles a grammar against the tokenizer in a worker thread, once per
  `StructuredOutputsParams.key`; every sample of every request with that key starts from a copy.
- `StructuredOutputs` (EngineCore's): requests wait outside the scheduler until their grammar is
  compiled, so a slow schema stalls nobody else; then each sample has its own matcher. Before a
  step runs, `bitmasks` gives each sampling row its allowed tokens; after it, `accept` advances
  the matchers with the sampled tokens and names the samples whose grammar has ended, which the
  engine finishes with finish_reason "stop", and those whose grammar refused a token (which the
  mask should have prevented), which it finishes with "error": the client gets an error.

A matcher only ever sees tokens that were sampled under its mask, so it never has to roll back:
a preempted request keeps its output tokens. A request verifying speculative drafts gets a mask
at each position: after the drafts before it, computed by walking them and rolling back. A draft
the grammar refuses is then rejected (the target's masked distribution gives it no mass), so the
positions after it need no mask, and verification stays exact.

A grammar with `reasoning_end` (the token ids of `</think>`, set by the server's reasoning parser)
starts only after the sample's output holds them: until then its positions get no mask and its
matcher sees no token (a `ReasoningGate` per sample watches for the end), as vLLM's structured
outputs leave a reasoning model's thinking free.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np

from pagoda.scheduling.messages import ScheduledRequest
from pagoda.scheduling.request import Request
from pagoda.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped)
ANY_JSON_OBJECT = '{"type": "object"}'


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of the params (not yet checked: LLMatcher or validation does)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if params.json is not None else ANY_JSON_OBJECT
        options: JsonCompileOptions = {"whitespace_flexible": not params.disable_any_whitespace}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json: {e}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex or "")
    if kind == "choice":
        lark = "start: " + " | ".join(json.dumps(c) for c in params.choice or ())
        return llguidance.LLMatcher.grammar_from_lark(lark)
    try:
        return llguidance.grammar_from("grammar", params.grammar or "")
    except ValueError as e:
        raise ValueError(f"structured_outputs.grammar: {e}") from None


def check_structured_outputs(params: StructuredOutputsParams | None) -> None:
    """ValueError naming the field unless the grammar compiles."""
    if params is None:
        return
    text = grammar_text(params)
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        raise ValueError(f"structured_outputs.{params.kind} is invalid: {error}")


class GrammarCompiler:
    """Compiled grammars by key, built in one worker thread (llguidance drops the GIL while it
    compiles). The tokenizer is loaded there too, on the first grammar."""

    def __init__(
        self, load_tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: Iterable[int]
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self._vocab_size = vocab_size
        self.eos = frozenset(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagoda-grammar")
        self._cache: OrderedDict[tuple[str, str, bool], Future[llguidance.LLMatcher]] = (
            OrderedDict()
        )
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> Future[llguidance.LLMatcher]:
        """A future pristine matcher for params (copy it: never advance this one)."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is None or (future.done() and future.exception() is not None):
                future = self._pool.submit(self._build, params)
                self._cache[key] = future
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
            return future

    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(
                self._load_tokenizer(), n_vocab=self._vocab_size, eos_token=sorted(self.eos)
            )
        return self._tokenizer

    def _build(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar_text(params), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind} is invalid: {matcher.get_error()}")
        return matcher

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class StructuredOutputs:
    def __init__(self, compiler: GrammarCompiler, vocab_size: int) -> None:
        self.compiler = compiler
        self.words = (vocab_size + 31) // 32  # int32 words of one bitmask row
        # Requests whose grammar is compiling: the leader (its n > 1 siblings hang off it).
        self.pending: list[tuple[Request, Future[llguidance.LLMatcher]]] = []
        self.matchers: dict[str, tuple[Request, llguidance.LLMatcher]] = {}
        self.gates: dict[str, ReasoningGate] = {}  # samples whose grammar waits for `</think>`
        self._executor: llguidance.LLExecutor | None = None

    @property
    def active(self) -> bool:
        return bool(self.pending or self.matchers)

    def add(self, leader: Request) -> None:
        params = leader.sampling_params.structured_outputs
        assert params is not None
        self.pending.append((leader, self.compiler.compile(params)))

    def holds(self, request_id: str) -> bool:
        """Whether a user request of this id is waiting for its grammar."""
        return any(r.parent_id == request_id for r, _ in self.pending)

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """Drop pending requests with these (user) ids; the dropped leaders."""
        ids = set(request_ids)
        dropped = [r for r, _ in self.pending if r.parent_id in ids or r.request_id in ids]
        self.pending = [(r, f) for r, f in self.pending if r not in dropped]
        return dropped

    def take_ready(self, wait_s: float = 0.0) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Leaders whose grammar is compiled (their samples get matchers), and those whose
        grammar failed with why. wait_s: how long to wait for the first pending one."""
        if self.pending and wait_s > 0:
            try:
                self.pending[0][1].result(timeout=wait_s)
            except Exception:  # noqa: BLE001 - reported below, with its request
                pass
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        still: list[tuple[Request, Future[llguidance.LLMatcher]]] = []
        for leader, future in self.pending:
            if not future.done():
                still.append((leader, future))
                continue
            error = future.exception()
            if error is not None:
                failed.append((leader, str(error)))
                continue
            template = future.result()
            end = leader.sampling_params.structured_outputs
            for sample in (leader, *leader.siblings):
                self.matchers[sample.request_id] = (sample, template.deep_copy())
                if end is not None and end.reasoning_end:
                    self.gates[sample.request_id] = ReasoningGate(end.reasoning_end)
            ready.append(leader)
        self.pending = still
        return ready, failed

    def bitmasks(self, scheduled: Sequence[ScheduledRequest]) -> dict[str, list[bytes]]:
        """Each grammar sample's allowed tokens at the positions it samples this step (bitmask
        rows as bytes, bit t of word t // 32 set when token t is allowed): one, or with k
        drafts up to k + 1, stopping after the first draft the grammar refuses."""
        # (sample, matcher, drafts, free: its leading positions still in the reasoning)
        rows: list[tuple[str, llguidance.LLMatcher, list[int], int]] = []
        for s in scheduled:
            for sid in s.sample_ids:
                if sid not in self.matchers:
                    continue
                drafts, gate = _drafts(s), self.gates.get(sid)
                free = 0 if gate is None else gate.free_positions(drafts)
                if free <= len(drafts) or drafts:  # a row with no mask at all is left out
                    rows.append((sid, self.matchers[sid][1], drafts, free))
        if not rows:
            return {}
        offsets = np.cumsum([0] + [1 + len(d) for _, _, d, _ in rows]).tolist()
        masks = np.full((offsets[-1], self.words), -1, dtype=np.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        masked = [(m, offsets[i] + f, d[f:]) for i, (_, m, d, f) in enumerate(rows) if f <= len(d)]
        plain = [(m, at) for m, at, rest in masked if not rest]
        if plain:
            self._executor.unsafe_compute_mask_ptr(
                plain, masks.ctypes.data, self.words * 4, offsets[-1]
            )
        drafted = [(m, at, rest) for m, at, rest in masked if rest]
        if drafted:  # rows after a refused draft stay all-allowed: nothing is emitted there
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                drafted, masks.ctypes.data, self.words * 4, offsets[-1]
            )
        return {
            sid: [masks[j].tobytes() for j in range(offsets[i], offsets[i + 1])]
            for i, (sid, _, _, _) in enumerate(rows)
        }

    def draft_mask(self, sample_id: str, output_token_ids: Sequence[int]) -> bytes | None:
        """A draft model's mask (runner/draft_sampling.py): the sample's allowed tokens after
        `output_token_ids`, its outputs as the runner holds them (those the engine has, then
        the step's new ones) and the drafts drawn so far. The matcher walks the tokens past the
        engine's and rolls back. None without a grammar, or where it refuses one of them."""
        entry = self.matchers.get(sample_id)
        if entry is None or entry[1].is_stopped():
            return None
        request, matcher = entry
        ahead = list(output_token_ids[len(request.output_token_ids) :])
        gate = self.gates.get(sample_id)
        if gate is not None:  # the grammar starts after the reasoning, if it ends in `ahead`
            free = gate.free_positions(ahead)
            if free > len(ahead):
                return None
            ahead = ahead[free:]
        walked = matcher.try_consume_tokens(ahead) if ahead else 0
        try:
            if walked < len(ahead):
                return None
            mask = np.full((1, self.words), -1, dtype=np.int32)
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(
                [(matcher, 0)], mask.ctypes.data, self.words * 4, 1
            )
            return mask.tobytes()
        finally:
            if walked:
                matcher.rollback(walked)

    def accept(self, outputs: Iterable[Any]) -> tuple[dict[str, int], dict[str, int]]:
        """Advance each sample's matcher with its new tokens. Returns the samples whose grammar
        has now ended, then those whose grammar refused a token (logged), each with how many of
        its new tokens to keep: a step that verified drafts may have sampled past the grammar's
        end (the EOS its mask then allows), which the engine drops, so the output is what plain
        decoding gives; a refused token and those after it are dropped."""
        ended: dict[str, int] = {}
        broken: dict[str, int] = {}
        for out in outputs:
            entry = self.matchers.get(out.request_id)
            if entry is None or not out.new_token_ids or entry[1].is_stopped():
                continue  # swept once finished
            matcher = entry[1]
            tokens = out.new_token_ids
            start = self._past_reasoning(out.request_id, tokens)
            for i, token in enumerate(tokens[start:], start):
                if out.finish_reason is not None and token in self.compiler.eos:
                    break  # the sample's own end: its matcher is swept
                if not matcher.consume_token(token):
                    logger.error(
                        "request %s: token %d does not match its grammar: %s",
                        out.request_id,
                        token,
                        matcher.get_error(),
                    )
                    broken[out.request_id] = i
                    break
                if matcher.is_stopped():
                    if i + 1 < len(tokens) or out.finish_reason is None:
                        ended[out.request_id] = i + 1
                    break
        return ended, broken

    def _past_reasoning(self, sample_id: str, tokens: Sequence[int]) -> int:
        """How many of a sample's new tokens its grammar skips: those up to and including the
        end of its reasoning (all of them while it goes on)."""
        gate = self.gates.get(sample_id)
        if gate is None:
            return 0
        for i, token in enumerate(tokens):
            if gate.feed(token):
                del self.gates[sample_id]
                return i + 1
        return len(tokens)

    def sweep(self) -> None:
        """Forget the matchers of finished samples."""
        done = [sid for sid, (r, _) in self.matchers.items() if r.status.is_finished]
        for sid in done:
            del self.matchers[sid]
            self.gates.pop(sid, None)


class ReasoningGate:
    """Watches a sample's output tokens for `end` (the token ids of `</think>`), after which its
    grammar applies."""

    def __init__(self, end: Sequence[int]) -> None:
        self.end = tuple(end)
        self.tail: tuple[int, ...] = ()  # the last len(end) tokens seen

    def feed(self, token: int) -> bool:
        """Take the sample's next token; True when it completes `end`."""
        self.tail = (*self.tail, token)[-len(self.end) :]
        return self.tail == self.end

    def free_positions(self, tokens: Sequence[int]) -> int:
        """How many positions starting now stay free of the grammar if `tokens` follow: up to
        and including the one that completes `end` (len(tokens) + 1: the end is not among
        them, and every position there is free). Leaves the gate as it was."""
        tail = self.tail
        for i, token in enumerate(tokens):
            tail = (*tail, token)[-len(self.end) :]
            if tail == self.end:
                return i + 1
        return len(tokens) + 1


def _drafts(s: ScheduledRequest) -> list[int]:
    """The draft tokens a scheduled request verifies this step."""
    return list(s.token_ids[len(s.token_ids) - s.num_draft_tokens :]) if s.num_draft_tokens else []
