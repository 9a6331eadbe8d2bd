"""PendingOutput: a step's results on their way to the host (see ModelRunner.execute)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagoda.runner.device import to_device
from pagoda.runner.sampler import LogprobsTensors
from pagoda.scheduling.messages import (
    PLACEHOLDER_TOKEN_ID,
    LogprobEntry,
    RunnerOutput,
    ScheduledRequest,
)


def _logprob_entries(t: LogprobsTensors) -> list[LogprobEntry]:
    return list(zip(*t.tolists()))


class PendingOutput:
    """A step's results on their way to the host. Built at the end of execute(), which queues
    the device-to-host copies (pinned memory, non_blocking) behind the step's work and records
    an event; get() waits for that event (the step's one host sync) and builds the
    RunnerOutput. On CPU the results are already on the host."""

    def __init__(
        self,
        row_ids: list[str],
        num_logprobs: list[int | None],
        sampled: torch.Tensor | None,
        logprobs: LogprobsTensors | None,
        prompt_logprobs: dict[str, LogprobsTensors],
        on_host: Callable[[list[int]], None] | None = None,
        propose: Callable[[dict[str, list[int]]], dict[str, list[int]]] | None = None,
        pooled: dict[str, bytes] | None = None,
    ) -> None:
        """row_ids[i] sampled sampled[i] and asked for num_logprobs[i] top logprobs (a row id
        repeats, in order, for each token it emitted); get() hands the sampled ids to on_host
        (the runner's rows record them), then the new tokens by request to `propose`, whose
        drafts it returns too. pooled: the step's embeddings (runner/pooler.py), on the host."""
        self.on_host = on_host
        self.pooled = pooled or {}
        self.propose = propose
        self.row_ids = row_ids
        self.num_logprobs = num_logprobs
        self.ready: torch.cuda.Event | None = None
        tensors = [t for t in (sampled, *(logprobs or ())) if t is not None]
        tensors += [t for lp in prompt_logprobs.values() for t in lp]
        if any(t.is_cuda for t in tensors):
            sampled = None if sampled is None else _to_host(sampled)
            logprobs = None if logprobs is None else LogprobsTensors(*map(_to_host, logprobs))
            prompt_logprobs = {
                rid: LogprobsTensors(*map(_to_host, lp)) for rid, lp in prompt_logprobs.items()
            }
            self.ready = torch.cuda.Event()
            self.ready.record()
        self.sampled = sampled
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs

    def get(self) -> RunnerOutput:
        if self.ready is not None:
            self.ready.synchronize()
        sampled: dict[str, list[int]] = {}
        if self.sampled is not None:
            tokens = self.sampled.tolist()
            if self.on_host is not None:
                self.on_host(tokens)
            for rid, token in zip(self.row_ids, tokens):
                sampled.setdefault(rid, []).append(token)
        logprobs: dict[str, list[LogprobEntry]] = {}
        if self.logprobs is not None:
            entries = _logprob_entries(self.logprobs)
            for rid, k, (ids, lps, rank) in zip(self.row_ids, self.num_logprobs, entries):
                if k is not None:
                    logprobs.setdefault(rid, []).append((ids[: k + 1], lps[: k + 1], rank))
        prompt = {rid: _logprob_entries(t) for rid, t in self.prompt_logprobs.items()}
        drafts = self.propose(sampled) if self.propose is not None else {}
        return RunnerOutput(sampled, logprobs, prompt, drafts, self.pooled)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A pinned host tensor that a non_blocking copy from `t` fills in stream order."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def fill_placeholders(
    scheduled: list[ScheduledRequest],
    input_ids: torch.Tensor,
    prev_sampled: torch.Tensor | None,
    prev_rows: dict[str, int],
    device: torch.device,
) -> None:
    """Write each placeholder input (the last input of a request whose previous step is still in
    flight) from the previous step's sampled ids prev_sampled (prev_rows: each request's row in
    them), on the device."""
    rows: dict[str, int] = {}
    end = 0
    for s in scheduled:
        end += len(s.token_ids)
        if s.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
            rows[s.request_id] = end - 1
    if not rows:
        return
    assert prev_sampled is not None, "a placeholder input without a previous step"
    dst = list(rows.values())
    src = [prev_rows[rid] for rid in rows]
    if dst == src == list(range(len(dst))):  # an unchanged decode batch: no index upload
        input_ids[: len(dst)].copy_(prev_sampled[: len(dst)])
    else:
        src_t = to_device(src, torch.int64, device)
        input_ids[to_device(dst, torch.int64, device)] = prev_sampled[src_t]
