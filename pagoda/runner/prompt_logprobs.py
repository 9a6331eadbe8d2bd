"""Prompt logprobs (SamplingParams.prompt_logprobs): each scored prompt position's logprob of the
prompt's next token and its top k, from a step's hidden states."""

from __future__ import annotations

import torch

from pagoda.models.interface import CausalLM
from pagoda.runner.device import to_device
from pagoda.runner.input_batch import InputBatch
from pagoda.runner.sampler import LogprobsTensors, Sampler
from pagoda.scheduling.messages import ScheduledRequest


def compute_prompt_logprobs(
    scheduled: list[ScheduledRequest],
    hidden: torch.Tensor,
    batch: InputBatch,
    model: CausalLM,
    sampler: Sampler,
    max_rows: int,
) -> dict[str, LogprobsTensors]:
    """The prompt logprobs of each scheduled request that scores prompt positions this step;
    hidden: the step's (num_tokens, hidden_size). The LM head runs on slices of max_rows rows
    (max_num_seqs): the (rows, vocab) temporaries then stay within the LM-head peak that
    profile_run measured (a whole chunk's would not)."""
    result: dict[str, LogprobsTensors] = {}
    token_start = 0
    for s in scheduled:
        n = s.num_prompt_logprob_tokens
        if n:
            request = batch.rows[s.request_id]
            k = request.params.prompt_logprobs or 0
            row = token_start + s.prompt_logprob_offset
            first = s.start + s.prompt_logprob_offset + 1
            targets = to_device(
                request.prompt_token_ids[first : first + n], torch.int64, hidden.device
            )
            parts = []
            for i in range(0, n, max_rows):
                logits = model.compute_logits(hidden[row + i : row + min(i + max_rows, n)])
                parts.append(sampler.compute_logprobs_for(logits, targets[i : i + max_rows], k))
            result[s.request_id] = (
                parts[0] if len(parts) == 1 else LogprobsTensors(*map(torch.cat, zip(*parts)))
            )
        token_start += len(s.token_ids)
    return result
