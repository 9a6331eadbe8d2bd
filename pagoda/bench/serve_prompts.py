"""`pagoda bench serve` workload: seeded random-token prompts of chosen token lengths, built
with the benchmark's tokenizer so that every server under test gets the same text."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ServeRequest:
    prompt: str
    prompt_len: int  # tokens of `prompt` under the benchmark's tokenizer (no special tokens)
    output_len: int


def ordinary_vocab(tokenizer: Any) -> list[int]:
    """Token ids that are not added/special tokens and decode to whole characters alone."""
    added = set(tokenizer.added_tokens_decoder) | set(tokenizer.all_special_ids)
    return [
        i for i in range(len(tokenizer)) if i not in added and "\ufffd" not in tokenizer.decode([i])
    ]


def special_token_ids(tokenizer: Any) -> list[int]:
    """EOS and every other special token: the ids --logit-bias-eos pushes down."""
    ids = set(tokenizer.all_special_ids)
    ids |= {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def num_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def fit_prompt(
    tokenizer: Any, ids: list[int], target: int, rng: random.Random, vocab: Sequence[int]
) -> tuple[str, int]:
    """Text that re-encodes to about `target` tokens, starting from random ids: decoding merges
    and splits tokens, so truncate or top up and re-decode until it holds (or stop trying).
    Returns (text, its token count)."""
    text = tokenizer.decode(ids)
    for _ in range(8):
        enc = tokenizer.encode(text, add_special_tokens=False)
        if len(enc) == target:
            return text, target
        if len(enc) > target:
            enc = enc[:target]
        else:
            enc = enc + [rng.choice(vocab) for _ in range(target - len(enc))]
        text = tokenizer.decode(enc)
    return text, num_tokens(tokenizer, text)


def build_requests(
    tokenizer: Any,
    num_prompts: int,
    input_len_range: tuple[int, int],
    output_len_range: tuple[int, int],
    seed: int = 0,
    shared_prefix_len: int = 0,
) -> list[ServeRequest]:
    """Seeded random-token prompts (the same for every server under the same tokenizer), drawn
    in this order: input lengths, output lengths, the shared prefix, then each prompt's ids.
    With shared_prefix_len = L every prompt is the same L-token text followed by U[A, B] more."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    rng = random.Random(seed)
    vocab = ordinary_vocab(tokenizer)
    input_lens = [rng.randint(*input_len_range) for _ in range(num_prompts)]
    output_lens = [rng.randint(*output_len_range) for _ in range(num_prompts)]
    prefix = ""
    if shared_prefix_len > 0:
        ids = [rng.choice(vocab) for _ in range(shared_prefix_len)]
        prefix, _ = fit_prompt(tokenizer, ids, shared_prefix_len, rng, vocab)
    out = []
    for n_in, n_out in zip(input_lens, output_lens):
        ids = [rng.choice(vocab) for _ in range(n_in)]
        text, _ = fit_prompt(tokenizer, ids, n_in, rng, vocab)
        prompt = prefix + text
        out.append(ServeRequest(prompt, num_tokens(tokenizer, prompt), n_out))
    return out


def load_bench_tokenizer(path: str | None) -> Any:
    from pagoda.loading.model_files import resolve_model
    from pagoda.loading.tokenizer import load_tokenizer

    folder, gguf = resolve_model(path)
    return load_tokenizer(folder, gguf)
