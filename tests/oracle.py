"""The one oracle every model and fast-path test compares pagoda with: HF transformers.

- `hf_greedy`: greedy tokens and per-step log-probabilities from HF, each prompt run alone
  (no padding), with HF's own KV cache. It always runs exactly max_tokens steps, as a pagoda
  request with ignore_eos and max_tokens does, so its finish reason is "length".
- `assert_greedy_matches`: the greedy outputs of one test's prompts against the oracle's (HF's,
  or for bf16 fast paths a pagoda reference run, `logprob_table`); `assert_outputs_match` takes
  LLM.generate's outputs. Tests call one of them, also for a single prompt: each applies
  `assert_greedy_match` to every prompt, then the tie budget (rule 5).
  `assert_greedy_match` checks one prompt, where `lp[s, t]` is the oracle's log-prob of token t
  at step s and `want`, `got` are the oracle's and pagoda's tokens:
  1. At each step s of the common length, got == want; with pagoda's log-probs given, pagoda's
     log-prob of its token is within `logprob_atol` of lp[s, got].
  2. At the first step s where got != want, the difference is accepted only as a near tie:
     lp[s, want] - lp[s, got] < tie_gap (the two chosen tokens, whatever their ranks). Steps after
     s are then not compared: they follow another prefix. An accepted tie is printed (`pytest -s`
     shows it) and s is returned; None when every compared token is equal.
  3. A tie needs at least MIN_EQUAL_TOKENS (8) equal tokens before it: the first 8 tokens
     (steps 0..7) agree, so a tie at s < 8 fails and the earliest accepted tie is at s == 8.
  4. Always, also after an accepted tie: pagoda gives as many tokens as the oracle, and pagoda's
     finish reason, where given, equals the expected one ("length" by default).
  5. (`assert_greedy_matches`) At most 1 in 5 prompts of a test may end at a tie: the test fails
     when 5 * ties > prompts, so a test of fewer than 5 prompts allows none.
  `tie_gap` defaults to TIE_GAP (1e-3), float32 rounding; bf16 paths pass BF16_TIE_GAP, whose
  reason is stated where it is defined.
- `forced_logprobs` / `assert_forced_match`: a fast path against its reference, teacher-forced.
  The reference runs free (greedy, with log-probs); `forced_logprobs` runs the fast path with
  each request's sampled token at step s replaced by the reference's token s, so both compute
  every step from the same prefix (its log-probs stay the fast path's own: top-k and the forced
  token's). HF as the reference of a free pagoda run is forced the other way: `hf_forced` scores
  pagoda's tokens in one forward. `assert_forced_match` checks one test's prompts, where `lp` and
  `fast` are the reference's and the fast path's log-probs at step s of the common prefix:
  6. Each step's token is the reference's (the forcing took), with as many tokens and, where
     given, the expected finish reason; at every step
     (a) |fast[tok] - lp[tok]| <= logprob_atol for the forced token tok, and
     (b) the fast path's top-1 token is the reference's (also when it only ties exactly with
         another: argmax's pick among equals is index order), or the reference ranks it within
         the gap: lp[ref top-1] - lp[fast top-1] < tie_gap. Such a tie is printed and counted, and
         allowed at any step and in any number of prompts: rules 3 and 5 bound what a free run
         abandons after a tie (the rest of its prompt), and no forced step is abandoned, since
         the next step has the reference's prefix again. The count and the largest (a)
         difference are printed (`pytest -s` shows them).
- `hf_logits` / `assert_logits_close`: full-prompt logits, compared elementwise.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from pagoda import LLM, SamplingParams
from pagoda.outputs import RequestOutput, SampleLogprobs
from pagoda.runner.device import to_device
from pagoda.runner.pending_output import PendingOutput
from pagoda.runner.sampler import SamplerOutput, SamplingMetadata, compute_logprobs_for
from pagoda.scheduling.messages import EngineRequest, ScheduledRequest, SchedulerOutput

TIE_GAP = 1e-3
# bf16 paths: logits rounded to bf16 step by 0.125 at |logit| in [16, 32), so an fp32-level
# difference between two bf16 computations (another kernel, fused code, accumulation order) that
# flips one rounding moves the gap of two logits by 0.125, and one on each of them by 0.25.
BF16_TIE_GAP = 0.25
# bf16 matmul outputs, teacher-forced (rule 6a): a token's log-prob is its bf16 logit less the
# log-sum-exp of them all, so one flipped rounding of a logit moves it by up to that logit's
# step, 0.25 at |logit| in [32, 64) (SmolLM2's top logits reach 37). Measured: compiled vs eager
# SmolLM2 Q4_1 on CPU (float32 between its bf16 matmuls), at most 0.099 over 240 steps
# (tests/engine/test_compiled_decode.py). Paths rounding every activation to bf16 drift further:
# see tests/gpu/test_engine_gpu.py.
BF16_LOGPROB_ATOL = 0.25
MIN_EQUAL_TOKENS = 8
PROMPTS_PER_TIE = 5  # a test may end at most 1 in 5 prompts at a tie

# (token ids, (len(token ids), vocab) log-probs) of one prompt, as hf_greedy gives them.
Expected = tuple[Sequence[int], torch.Tensor]


@torch.no_grad()
def hf_from_gguf(path: str) -> torch.nn.Module:
    """HF transformers' float32 model of a GGUF file, by its own conversion (config, tensor
    names, dequantization), from a copy of the file without its tokenizer arrays
    (`model_only_gguf`): gguf's GGUFReader parses every array element in Python, and a model
    needs none of them (about 40 s of a 150k vocabulary's 65 s load on 2 cores). from_pretrained
    reads the metadata twice (config, then weights); the second read reuses the first reader."""
    import os
    import tempfile

    import gguf
    from transformers import AutoModelForCausalLM

    real = gguf.GGUFReader
    readers: dict[str, object] = {}

    def reader(file: str, *args: object, **kwargs: object) -> object:
        key = os.path.realpath(file)
        if key not in readers:
            readers[key] = real(file, *args, **kwargs)  # type: ignore[arg-type]
        return readers[key]

    with tempfile.TemporaryDirectory(prefix="pagoda-oracle-") as folder:
        name = os.path.basename(path)
        model_only_gguf(path, os.path.join(folder, name))
        gguf.GGUFReader = reader  # type: ignore[assignment,misc]
        try:
            model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, dtype=torch.float32
            )
        finally:
            gguf.GGUFReader = real  # type: ignore[misc]
    return model.eval()


_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


def model_only_gguf(src: str, dst: str) -> None:
    """Copy GGUF file `src` to `dst` without its `tokenizer.ggml.*` arrays (tokens, merges,
    scores, token types): the same tensor bytes, tensor infos and other metadata (the GGUF
    layout: header, key-value pairs, tensor infos, then the data at the next multiple of
    `general.alignment`, 32 by default, with tensor offsets relative to it). transformers takes
    a config's missing vocab_size from the token list (len(tokens)): the copy states it as
    `{arch}.vocab_size` instead, the same number."""
    import shutil
    import struct

    import numpy as np

    data = np.memmap(src, mode="r")
    buf = data.data
    pos = 24  # magic, version, tensor count, key-value count

    def string(at: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", buf, at)
        return bytes(buf[at + 8 : at + 8 + length]).decode(), at + 8 + length

    def skip_value(kind: int, at: int) -> tuple[int, int]:
        """(end of the value, element count for an array else 1)"""
        if kind == _STRING:
            return string(at)[1], 1
        if kind != _ARRAY:
            return at + _SCALAR_BYTES[kind], 1
        elem, count = struct.unpack_from("<IQ", buf, at)
        at += 12
        if elem == _STRING:
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", buf, at)
                at += 8 + length
            return at, count
        return at + count * _SCALAR_BYTES[elem], count

    num_tensors, num_kv = struct.unpack_from("<QQ", buf, 8)
    kept: list[bytes] = []
    values: dict[str, tuple[int, int, int]] = {}  # key: (kind, value offset, count)
    for _ in range(num_kv):
        start = pos
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        end, count = skip_value(kind, pos + 4)
        values[key] = (kind, pos + 4, count)
        if not (kind == _ARRAY and key.startswith("tokenizer.ggml.")):
            kept.append(bytes(buf[start:end]))
        pos = end
    infos_start = pos
    for _ in range(num_tensors):
        _, pos = string(pos)
        (dims,) = struct.unpack_from("<I", buf, pos)
        pos += 4 + 8 * dims + 4 + 8
    infos = bytes(buf[infos_start:pos])
    align = 32
    if "general.alignment" in values:
        (align,) = struct.unpack_from("<I", buf, values["general.alignment"][1])
    data_start = -(-pos // align) * align
    arch = string(values["general.architecture"][1])[0]
    vocab_key = f"{arch}.vocab_size"
    if vocab_key not in values and "tokenizer.ggml.tokens" in values:
        encoded = vocab_key.encode()
        count = values["tokenizer.ggml.tokens"][2]
        kept.append(struct.pack("<Q", len(encoded)) + encoded + struct.pack("<II", _UINT32, count))
    head = bytes(buf[:16]) + struct.pack("<Q", len(kept)) + b"".join(kept) + infos
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fout.write(head + bytes(-len(head) % align))
        fin.seek(data_start)
        shutil.copyfileobj(fin, fout, 16 << 20)


def hf_greedy(
    model: torch.nn.Module, prompt_ids_list: Sequence[Sequence[int]], max_tokens: int
) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: (max_tokens greedy token ids, (max_tokens, vocab) float32 log-probs)."""
    device = next(model.parameters()).device
    results = []
    for prompt_ids in prompt_ids_list:
        input_ids = torch.tensor([list(prompt_ids)], device=device)
        past = None
        tokens: list[int] = []
        steps: list[torch.Tensor] = []
        for _ in range(max_tokens):
            out = model(input_ids=input_ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logprobs = torch.log_softmax(out.logits[0, -1].float(), dim=-1).cpu()
            token = int(logprobs.argmax())
            tokens.append(token)
            steps.append(logprobs)
            input_ids = torch.tensor([[token]], device=device)
        results.append((tokens, torch.stack(steps)))
    return results


@torch.no_grad()
def hf_logits(model: torch.nn.Module, prompt_ids: Sequence[int]) -> torch.Tensor:
    """(len(prompt_ids), vocab) float32 logits of one prompt."""
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([list(prompt_ids)], device=device), use_cache=False)
    return out.logits[0].float().cpu()


def assert_logits_close(
    pagoda_logits: torch.Tensor, hf_logits: torch.Tensor, atol: float, what: str = "logits"
) -> None:
    pagoda_logits = pagoda_logits.float().cpu()
    assert pagoda_logits.shape == hf_logits.shape, (
        f"{what}: shape {tuple(pagoda_logits.shape)} != HF {tuple(hf_logits.shape)}"
    )
    err = (pagoda_logits - hf_logits).abs()
    worst = int(err.argmax())
    row, col = divmod(worst, hf_logits.shape[-1])
    assert err.max() <= atol, (
        f"{what}: max |pagoda - HF| = {err.max():.3e} > {atol:.1e} at row {row}, token {col} "
        f"(pagoda {pagoda_logits[row, col]:.6f}, HF {hf_logits[row, col]:.6f})"
    )


def logprob_table(logprobs: SampleLogprobs, vocab_size: int) -> torch.Tensor:
    """(len(logprobs), vocab_size) float32 table of a pagoda reference run's top-k log-probs,
    -inf elsewhere: a token outside the reference's top k is never within a tie gap."""
    table = torch.full((len(logprobs), vocab_size), float("-inf"))
    for step, entry in enumerate(logprobs):
        for token, lp in entry.items():
            table[step, token] = lp.logprob
    return table


def assert_greedy_match(
    pagoda_tokens: Sequence[int],
    hf_tokens: Sequence[int],
    hf_step_logprobs: torch.Tensor,
    pagoda_logprobs: Sequence[float] | None = None,
    *,
    finish_reason: str | None = None,
    expected_finish_reason: str = "length",
    tie_gap: float = TIE_GAP,
    logprob_atol: float = 1e-3,
    what: str = "greedy tokens",
) -> int | None:
    """Rules 1-4 of the module doc for one prompt. `pagoda_logprobs`: pagoda's log-prob of each
    of its tokens; `finish_reason`: pagoda's. Returns the step of an accepted tie, or None."""
    pagoda_tokens, hf_tokens = list(pagoda_tokens), list(hf_tokens)
    assert hf_step_logprobs.shape[0] == len(hf_tokens), "one row of oracle log-probs per token"
    if pagoda_logprobs is not None:
        assert len(pagoda_logprobs) == len(pagoda_tokens), "one pagoda log-prob per token"
    both = f"\n  pagoda: {pagoda_tokens}\n  oracle: {hf_tokens}"
    tie_step = None
    for step, (got, want) in enumerate(zip(pagoda_tokens, hf_tokens)):
        if got != want:
            _check_tie(step, got, want, hf_step_logprobs[step], tie_gap, what, both)
            tie_step = step
        if pagoda_logprobs is not None:
            hf_lp = float(hf_step_logprobs[step, got])
            assert abs(pagoda_logprobs[step] - hf_lp) <= logprob_atol, (
                f"{what}: log-prob of token {got} at step {step}: pagoda "
                f"{pagoda_logprobs[step]:.6f}, oracle {hf_lp:.6f} (atol {logprob_atol})"
            )
        if tie_step is not None:
            break
    assert len(pagoda_tokens) == len(hf_tokens), (
        f"{what}: pagoda produced {len(pagoda_tokens)} tokens, the oracle {len(hf_tokens)}{both}"
    )
    if finish_reason is not None:
        assert finish_reason == expected_finish_reason, (
            f"{what}: finish reason {finish_reason!r}, expected {expected_finish_reason!r}"
        )
    return tie_step


def _check_tie(
    step: int,
    got: int,
    want: int,
    step_logprobs: torch.Tensor,
    tie_gap: float,
    what: str,
    both: str,
) -> None:
    """Rules 2 and 3 at the first differing step; prints the accepted tie."""
    lp_want, lp_got = float(step_logprobs[want]), float(step_logprobs[got])
    gap = lp_want - lp_got
    rank = int((step_logprobs > lp_got).sum()) + 1
    seen = (
        f"step {step}: pagoda {got} (oracle log-prob {lp_got:.6f}, rank {rank}), "
        f"oracle {want} ({lp_want:.6f}), gap {gap:.3e}"
    )
    assert gap < tie_gap, f"{what}: tokens differ at {seen}, not a near tie (< {tie_gap:.1e}){both}"
    assert step >= MIN_EQUAL_TOKENS, (
        f"{what}: near tie at {seen} after only {step} equal tokens "
        f"(a tie needs at least {MIN_EQUAL_TOKENS}){both}"
    )
    print(f"oracle: near tie accepted, {what}, {seen} < {tie_gap:.1e}")


def assert_greedy_matches(
    pagoda_tokens: Sequence[Sequence[int]],
    expected: Sequence[Expected],
    pagoda_logprobs: Sequence[Sequence[float]] | None = None,
    *,
    finish_reasons: Sequence[str | None] | None = None,
    expected_finish_reason: str = "length",
    tie_gap: float = TIE_GAP,
    logprob_atol: float = 1e-3,
) -> list[int | None]:
    """All rules of the module doc for one test's prompts, in order: `expected[i]` is prompt i's
    (oracle tokens, log-probs); `pagoda_logprobs[i]` and `finish_reasons[i]` are pagoda's.
    Prints the number of ties; returns each prompt's tie step (None: all equal)."""
    assert len(pagoda_tokens) == len(expected), (
        f"{len(pagoda_tokens)} pagoda outputs for {len(expected)} prompts"
    )
    for given in (pagoda_logprobs, finish_reasons):
        assert given is None or len(given) == len(expected), "one entry per prompt"
    ties = []
    for i, (tokens, (hf_tokens, hf_step_logprobs)) in enumerate(zip(pagoda_tokens, expected)):
        ties.append(
            assert_greedy_match(
                tokens,
                hf_tokens,
                hf_step_logprobs,
                None if pagoda_logprobs is None else pagoda_logprobs[i],
                finish_reason=None if finish_reasons is None else finish_reasons[i],
                expected_finish_reason=expected_finish_reason,
                tie_gap=tie_gap,
                logprob_atol=logprob_atol,
                what=f"prompt {i}",
            )
        )
    assert_tie_budget(ties, f"oracle (tie gap {tie_gap:.1e})")
    return ties


def assert_tie_budget(ties: Sequence[int | None], who: str) -> None:
    """Rule 5: at most 1 in PROMPTS_PER_TIE prompts ended at a tie (each prompt's tie step, None
    where all its tokens were equal); prints the count."""
    num_ties = sum(step is not None for step in ties)
    print(f"{who}: {num_ties} of {len(ties)} prompts ended at a near tie")
    assert num_ties * PROMPTS_PER_TIE <= len(ties), (
        f"{num_ties} of {len(ties)} prompts ended at a near tie, at steps {list(ties)}: more "
        f"than 1 in {PROMPTS_PER_TIE}"
    )


def assert_outputs_match(
    outputs: Sequence[RequestOutput], expected: Sequence[Expected], tie_gap: float = TIE_GAP
) -> list[int | None]:
    """`assert_greedy_matches` on the first completion of each of LLM.generate's (or chat's)
    outputs: tokens and finish reasons."""
    completions = [out.outputs[0] for out in outputs]
    return assert_greedy_matches(
        [c.token_ids for c in completions],
        expected,
        finish_reasons=[c.finish_reason for c in completions],
        tie_gap=tie_gap,
    )


@torch.no_grad()
def hf_forced(
    model: torch.nn.Module,
    prompt_ids_list: Sequence[Sequence[int]],
    forced_tokens: Sequence[Sequence[int]],
) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: (its forced tokens, (len(forced), vocab) float32 log-probs of HF's next token
    after the prompt and forced[:s], for each step s), from one forward (no KV cache)."""
    device = next(model.parameters()).device
    results = []
    for prompt_ids, forced in zip(prompt_ids_list, forced_tokens, strict=True):
        ids = [*prompt_ids, *forced[:-1]]
        out = model(input_ids=torch.tensor([ids], device=device), use_cache=False)
        logits = out.logits[0, len(prompt_ids) - 1 :].float()
        results.append((list(forced), torch.log_softmax(logits, dim=-1).cpu()))
    return results


class _ForcedSampler:
    """Stands in for the runner's Sampler while forcing: row r of a step is the r-th sampling
    request of `scheduled` (the step's SchedulerOutput, set before the runner samples), and it
    takes forced[request id][step], step = the outputs sampled before this one (placeholders
    included, so also under async scheduling). Log-probs come from the step's own logits."""

    def __init__(self, forced: dict[str, list[int]]) -> None:
        self.forced = forced
        self.scheduled: list[ScheduledRequest] = []

    def __call__(
        self, logits: torch.Tensor, meta: SamplingMetadata, greedy: torch.Tensor | None = None
    ) -> SamplerOutput:
        tokens = []
        for s in self.scheduled:
            if not s.sample_ids:
                continue  # a prompt chunk short of the prompt's end
            assert s.sample_ids == [s.request_id], "forcing needs n == 1"
            assert s.request_id in self.forced, f"request {s.request_id} is not forced"
            forced = self.forced[s.request_id]
            assert s.num_output_tokens < len(forced), (
                f"request {s.request_id} samples token {s.num_output_tokens} of {len(forced)}"
            )
            tokens.append(forced[s.num_output_tokens])
        assert len(tokens) == logits.shape[0], f"{len(tokens)} forced rows, {logits.shape[0]} rows"
        sampled = to_device(tokens, torch.int64, logits.device)
        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = compute_logprobs_for(logits, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled, logprobs)

    compute_logprobs_for = staticmethod(compute_logprobs_for)  # prompt log-probs, unchanged


@contextmanager
def teacher_forcing(llm: LLM, forced_tokens: Sequence[Sequence[int]]) -> Iterator[None]:
    """Within the block, the i-th request added to `llm` (n = 1) samples forced_tokens[i][s] at
    its step s: its output tokens, and the inputs of its next steps, are the forced ones.
    Afterwards the engine's add_request and runner's execute and sampler are as before."""
    engine, runner = llm.engine, llm.engine.executor.runner
    forcing = _ForcedSampler({})
    add_request, execute = engine.add_request, runner.execute

    def add(req: EngineRequest) -> None:
        assert req.sampling_params.n == 1, "forcing needs n == 1"
        assert len(forcing.forced) < len(forced_tokens), "more requests than forced sequences"
        forcing.forced[req.request_id] = list(forced_tokens[len(forcing.forced)])
        add_request(req)

    def execute_forced(out: SchedulerOutput) -> PendingOutput:
        forcing.scheduled = out.scheduled
        return execute(out)

    # Instance attributes shadowing the class's methods; deleted afterwards, not set back to the
    # bound methods (which would hold the engine in a reference cycle).
    assert "add_request" not in vars(engine) and "execute" not in vars(runner)
    sampler = runner.sampler
    engine.add_request = add  # type: ignore[method-assign]
    runner.execute = execute_forced  # type: ignore[method-assign]
    runner.sampler = forcing  # type: ignore[assignment]
    try:
        yield
    finally:
        runner.sampler = sampler
        del runner.execute
        del engine.add_request


def forced_logprobs(
    llm: LLM,
    prompts: Sequence[Sequence[int]],
    forced_tokens: Sequence[Sequence[int]],
    num_logprobs: int,
) -> list[RequestOutput]:
    """`llm`'s greedy run of each prompt teacher-forced to its forced tokens (as many steps, EOS
    ignored), with each step's top `num_logprobs` (>= 1: rule 6 needs the top-1) and the forced
    token's own log-prob."""
    assert num_logprobs >= 1, "the top-1 token is compared: num_logprobs >= 1"
    params = [
        SamplingParams(temperature=0.0, max_tokens=len(f), ignore_eos=True, logprobs=num_logprobs)
        for f in forced_tokens
    ]
    with teacher_forcing(llm, forced_tokens):
        batch = [{"prompt_token_ids": list(p)} for p in prompts]
        return llm.generate(batch, params, use_tqdm=False)


def expected_from(outputs: Sequence[RequestOutput], vocab_size: int) -> list[Expected]:
    """A pagoda reference run as the oracle's (tokens, log-prob table) per prompt."""
    return [
        (o.outputs[0].token_ids, logprob_table(o.outputs[0].logprobs or [], vocab_size))
        for o in outputs
    ]


def assert_forced_match(
    outputs: Sequence[RequestOutput],
    expected: Sequence[Expected],
    *,
    tie_gap: float,
    logprob_atol: float,
    expected_finish_reason: str = "length",
) -> int:
    """Rule 6 of the module doc: `outputs[i]` is the fast path's run of prompt i forced to (or,
    for `hf_forced`, forcing) `expected[i]`'s tokens, with log-probs. Prints and returns the
    number of ties, and prints the largest forced-token log-prob difference."""
    assert len(outputs) == len(expected), f"{len(outputs)} outputs for {len(expected)} prompts"
    ties, steps, worst = 0, 0, 0.0
    for i, (out, (tokens, table)) in enumerate(zip(outputs, expected)):
        completion = out.outputs[0]
        what = f"prompt {i}"
        assert list(completion.token_ids) == list(tokens), (
            f"{what}: not forced to the reference's tokens\n  fast: {completion.token_ids}"
            f"\n  reference: {list(tokens)}"
        )
        assert completion.finish_reason == expected_finish_reason, (
            f"{what}: finish reason {completion.finish_reason!r}, "
            f"expected {expected_finish_reason!r}"
        )
        assert completion.logprobs is not None and len(completion.logprobs) == len(tokens), (
            f"{what}: one log-prob entry per token needed"
        )
        assert table.shape[0] == len(tokens), f"{what}: one row of reference log-probs per token"
        for step, (token, entry) in enumerate(zip(tokens, completion.logprobs)):
            assert any(lp.rank == 1 for lp in entry.values()), f"{what}: no top-1 at step {step}"
            fast = logprob_table([entry], table.shape[1])[0]
            ref = table[step]
            diff = abs(float(fast[token]) - float(ref[token]))
            worst = max(worst, diff)
            assert diff <= logprob_atol, (
                f"{what}: log-prob of forced token {token} at step {step}: fast "
                f"{float(fast[token]):.6f}, reference {float(ref[token]):.6f} "
                f"(|diff| {diff:.3e} > atol {logprob_atol})"
            )
            ref_top = int(ref.argmax())
            # Of equal top log-probs argmax returns the first index: prefer the reference's.
            fast_top = ref_top if fast[ref_top] == fast.max() else int(fast.argmax())
            if fast_top != ref_top:
                gap = float(ref[ref_top] - ref[fast_top])
                seen = (
                    f"{what}, step {step}: fast top-1 {fast_top} (reference log-prob "
                    f"{float(ref[fast_top]):.6f}), reference top-1 {ref_top} "
                    f"({float(ref[ref_top]):.6f}), gap {gap:.3e}"
                )
                assert gap < tie_gap, f"top-1 differs at {seen}, not a near tie (< {tie_gap:.1e})"
                print(f"oracle: forced near tie, {seen} < {tie_gap:.1e}")
                ties += 1
        steps += len(tokens)
    print(
        f"oracle: forced, {steps} steps of {len(outputs)} prompts: {ties} near ties "
        f"(tie gap {tie_gap:.1e}); max |fast - reference| log-prob of the forced token "
        f"{worst:.3e} (atol {logprob_atol:.1e})"
    )
    return ties
