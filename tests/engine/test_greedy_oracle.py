"""Greedy output of the whole engine equals HF transformers token for token (near-tie rules of
tests/oracle.py)."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from tests.conftest import TINY_ARCHS
from tests.oracle import assert_greedy_matches, assert_outputs_match, hf_greedy, hf_logits

# float32 through the C++ kernels against HF's SDPA: the same tolerance as the models' logits
# tests (tests/models/test_models.py, TINY_ATOL), on log-probabilities
LOGPROB_ATOL = 1e-4

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "List three colors:",
    "The quick brown fox",
    "Water boils at a temperature of",
    "In 1492, Christopher Columbus",
    "Machine learning is a field of study that",
    "My favourite recipe for pancakes uses",
]

CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a planet."},
    ],
]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_smollm2_greedy_matches_hf(smollm2_llm: LLM, smollm2_hf) -> None:
    tok = smollm2_llm.get_tokenizer()
    chat_texts = [smollm2_llm.apply_chat_template(c) for c in CHATS]
    prompt_ids = [tok.encode(p) for p in PROMPTS] + [
        tok.encode(t, add_special_tokens=False) for t in chat_texts
    ]
    outs = smollm2_llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], _greedy(32))
    chat_outs = smollm2_llm.chat(CHATS, _greedy(32), use_tqdm=False)
    expected = hf_greedy(smollm2_hf, prompt_ids, 32)
    # the chats twice: as token ids through generate, and as messages through chat
    assert_outputs_match(outs + chat_outs, expected + expected[len(PROMPTS) :])


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_models_greedy_match_hf(arch: str, tiny_model_dir, tiny_hf_model) -> None:
    path = tiny_model_dir(arch)
    llm = LLM(path, quantization="none", num_gpu_blocks_override=256, max_num_batched_tokens=64)
    prompt_ids = [[(7 * i + 3 * j) % 1000 + 5 for j in range(5 + 3 * i)] for i in range(6)]
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], _greedy(24))
    expected = hf_greedy(tiny_hf_model(arch), prompt_ids, 24)
    assert_outputs_match(outs, expected)


@pytest.mark.parametrize("arch", ["mistral", "gemma3", "deepseek_v3"])
def test_chunked_engine_logprobs_match_hf(arch: str, tiny_model_dir, tiny_hf_model) -> None:
    """The sliding-window families (window 6, conftest.py) through the whole engine on the
    C++ kernels, and DeepSeek's latent attention (absorbed form, latent cache) on the torch
    backend: prompts of 3 to 30 tokens prefilled in chunks of at most 16 tokens beside
    other requests' decodes, then 24 decoded tokens; tokens, their log-probs and every prompt
    token's log-prob against HF."""
    path = tiny_model_dir(arch)
    llm = LLM(path, quantization="none", num_gpu_blocks_override=256, max_num_batched_tokens=16)
    prompt_ids = [[(11 * i + 5 * j) % 1000 + 7 for j in range(3 + 9 * i)] for i in range(4)]
    params = SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    hf_model = tiny_hf_model(arch)
    completions = [out.outputs[0] for out in outs]
    assert_greedy_matches(
        [c.token_ids for c in completions],
        hf_greedy(hf_model, prompt_ids, 24),
        [[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] for c in completions],
        finish_reasons=[c.finish_reason for c in completions],
        logprob_atol=LOGPROB_ATOL,
    )
    for ids, out in zip(prompt_ids, outs):
        expected = torch.log_softmax(hf_logits(hf_model, ids), dim=-1)
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        got = [out.prompt_logprobs[pos][token].logprob for pos, token in enumerate(ids) if pos]
        want = [float(expected[pos - 1, token]) for pos, token in enumerate(ids) if pos]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=LOGPROB_ATOL)


@torch.no_grad()
def test_allowed_token_ids_greedy_matches_hf_restricted_argmax(
    tiny_model_dir, tiny_hf_model
) -> None:
    """vLLM's allowed_token_ids: greedy picks HF's argmax over the allowed tokens only, each row
    its own set, beside rows without one; random samples never leave the set."""
    llm = LLM(tiny_model_dir("llama"), quantization="none", num_gpu_blocks_override=128)
    hf = tiny_hf_model("llama")
    prompts = [[(5 * i + 11 * j) % 900 + 7 for j in range(6 + i)] for i in range(3)]
    sets = [(3, 40, 41, 500, 777), None, (9, 900, 901)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, allowed_token_ids=s)
        for s in sets
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, allowed, out in zip(prompts, sets, outs):
        ids = list(prompt)
        for _ in range(8):
            logits = hf_logits(hf, ids)[-1]
            if allowed is not None:
                keep = torch.full_like(logits, float("-inf"))
                keep[list(allowed)] = logits[list(allowed)]
                logits = keep
            ids.append(int(logits.argmax()))
        assert list(out.outputs[0].token_ids) == ids[len(prompt) :]
    random = SamplingParams(n=4, seed=1, max_tokens=16, ignore_eos=True, allowed_token_ids=sets[0])
    sampled = llm.generate({"prompt_token_ids": prompts[0]}, random, use_tqdm=False)[0]
    tokens = {t for c in sampled.outputs for t in c.token_ids}
    assert tokens <= set(sets[0]) and len(tokens) > 1
