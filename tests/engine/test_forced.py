"""Teacher forcing (tests/oracle.py): pagoda's forced run (forced_logprobs) outputs the forced
tokens, its KV cache holds them (its log-probs at step k are those of a free run of the prompt
followed by forced[:k]), and the engine samples as before afterwards; HF's (hf_forced) scores
tokens as HF's own decoding does."""

from __future__ import annotations

from typing import Any

import pytest

from pagoda import LLM, SamplingParams
from pagoda.runner.sampler import Sampler
from tests.oracle import forced_logprobs, hf_forced, hf_greedy, teacher_forcing

# The second prompt is longer than the step budget (16): it is prefilled in chunks beside the
# first one's decodes.
PROMPTS = [[(7 * j + 3) % 900 + 5 for j in range(5)], [(11 * j + 2) % 900 + 5 for j in range(19)]]
STEPS = 10
TOP = 5
ATOL = 1e-4  # float32: a prefill and a decode step of the same prefix


# Async scheduling (the CUDA default) samples each decode step before the previous step's
# update: the forced token is then the decode's input straight from the device.
@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request: pytest.FixtureRequest, tiny_model_dir: Any) -> LLM:
    llm = LLM(
        tiny_model_dir("llama"),
        quantization="none",
        num_gpu_blocks_override=64,
        block_size=4,
        max_num_batched_tokens=16,
        max_model_len=64,
        async_scheduling=request.param,
    )
    assert llm.engine.async_scheduling == request.param
    return llm


def _greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def test_forced_tokens_are_output_and_cached(llm: LLM) -> None:
    batch = [{"prompt_token_ids": p} for p in PROMPTS]
    greedy = [o.outputs[0].token_ids for o in llm.generate(batch, _greedy(STEPS), use_tqdm=False)]
    forced = [[(37 * k + 101 * i) % 997 + 3 for k in range(STEPS)] for i in range(len(PROMPTS))]
    assert all(f[k] != g[k] for f, g in zip(forced, greedy) for k in range(STEPS))

    outs = forced_logprobs(llm, PROMPTS, forced, TOP)
    assert [o.outputs[0].token_ids for o in outs] == forced
    assert all(o.outputs[0].finish_reason == "length" for o in outs)

    # Free runs of prompt + forced[:k] (next token), and of prompt + forced scoring each forced
    # token: the forced run's step k, top-k and forced token alike.
    prefixes = [p + f[:k] for p, f in zip(PROMPTS, forced) for k in range(STEPS)]
    free = llm.generate(
        [{"prompt_token_ids": p} for p in prefixes], _greedy(1, logprobs=TOP), use_tqdm=False
    )
    scored = llm.generate(
        [{"prompt_token_ids": p + f} for p, f in zip(PROMPTS, forced)],
        _greedy(1, prompt_logprobs=0),
        use_tqdm=False,
    )
    for i, (out, prompt) in enumerate(zip(outs, PROMPTS)):
        steps = out.outputs[0].logprobs
        assert steps is not None and len(steps) == STEPS
        prompt_logprobs = scored[i].prompt_logprobs
        assert prompt_logprobs is not None
        for k, entry in enumerate(steps):
            token = forced[i][k]
            want = prompt_logprobs[len(prompt) + k]
            assert want is not None
            assert entry[token].logprob == pytest.approx(want[token].logprob, abs=ATOL), (i, k)
            top = free[i * STEPS + k].outputs[0].logprobs
            assert top is not None
            top_k = {t: lp.logprob for t, lp in entry.items() if t != token}
            free_k = {t: lp.logprob for t, lp in top[0].items() if t != token}
            assert top_k.keys() == free_k.keys(), (i, k)
            for t, lp in free_k.items():
                assert top_k[t] == pytest.approx(lp, abs=ATOL), (i, k, t)

    # Restored: the runner's own sampler and methods, and greedy tokens as before.
    runner = llm.engine.executor.runner
    assert type(runner.sampler) is Sampler
    assert "execute" not in vars(runner) and "add_request" not in vars(llm.engine)
    again = llm.generate(batch, _greedy(STEPS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == greedy


def test_forcing_is_undone_after_a_failure(llm: LLM) -> None:
    with pytest.raises(AssertionError, match="samples token 2 of 2"):
        with teacher_forcing(llm, [[5, 6]]):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], _greedy(3), use_tqdm=False)
    runner = llm.engine.executor.runner
    assert type(runner.sampler) is Sampler and "execute" not in vars(runner)


def test_hf_forced_scores_as_hf_greedy(tiny_hf_model: Any) -> None:
    model = tiny_hf_model("llama")
    greedy = hf_greedy(model, PROMPTS, STEPS)
    forced = hf_forced(model, PROMPTS, [tokens for tokens, _ in greedy])
    for (tokens, logprobs), (forced_tokens, scores) in zip(greedy, forced):
        assert forced_tokens == tokens
        assert scores.shape == logprobs.shape
        assert (scores - logprobs).abs().max() <= ATOL
