"""The one oracle every model and fast-path test compares pagoda with: HF transformers.

- `hf_greedy`: greedy tokens and per-step log-probabilities from HF, each prompt run alone
  (no padding), with HF's own KV cache.
- `assert_greedy_match`: tokens must be equal. At the first difference, accept only a near tie:
  the oracle's top-2 log-prob gap at that step is < TIE_GAP and pagoda's token is in the oracle's
  top-5; then the rest of that sequence is not compared (it follows a different prefix).
- `hf_logits` / `assert_logits_close`: full-prompt logits, compared elementwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

TIE_GAP = 1e-3
TIE_TOP_K = 5


@torch.no_grad()
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


def assert_greedy_match(
    pagoda_tokens: Sequence[int],
    hf_tokens: Sequence[int],
    hf_step_logprobs: torch.Tensor,
    pagoda_logprobs: Sequence[float] | None = None,
    logprob_atol: float = 1e-3,
) -> None:
    """Near-tie rule (module doc). With `pagoda_logprobs` (pagoda's log-prob of each of its
    tokens), those must also be within `logprob_atol` of HF's, up to the first difference."""
    pagoda_tokens, hf_tokens = list(pagoda_tokens), list(hf_tokens)
    for step, (got, want) in enumerate(zip(pagoda_tokens, hf_tokens)):
        if got != want:
            top = torch.topk(hf_step_logprobs[step], TIE_TOP_K)
            top_ids = top.indices.tolist()
            gap = float(top.values[0] - top.values[1])
            if gap < TIE_GAP and got in top_ids:
                return
            ranked = ", ".join(f"{i}: {v:.5f}" for i, v in zip(top_ids, top.values.tolist()))
            raise AssertionError(
                f"greedy tokens differ at step {step}: pagoda {got}, HF {want}; HF top-{TIE_TOP_K} "
                f"{{{ranked}}}, top-2 gap {gap:.2e} (a near tie needs a gap < {TIE_GAP} and "
                f"pagoda's token in the top {TIE_TOP_K})\n"
                f"  pagoda: {pagoda_tokens}\n  HF:     {hf_tokens}"
            )
        if pagoda_logprobs is not None:
            hf_lp = float(hf_step_logprobs[step, want])
            assert abs(pagoda_logprobs[step] - hf_lp) <= logprob_atol, (
                f"log-prob of token {want} at step {step}: pagoda {pagoda_logprobs[step]:.6f}, "
                f"HF {hf_lp:.6f} (atol {logprob_atol})"
            )
    assert len(pagoda_tokens) == len(hf_tokens), (
        f"pagoda produced {len(pagoda_tokens)} tokens, HF {len(hf_tokens)}\n"
        f"  pagoda: {pagoda_tokens}\n  HF:     {hf_tokens}"
    )
