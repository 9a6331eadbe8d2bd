"""PendingOutput: a step's results on their way to the host (see ModelRunner.execute)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagoda.runner.sampler import LogprobsTensors
from pagoda.scheduling.messages import LogprobEntry, RunnerOutput


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
    ) -> None:
        """row_ids[i] sampled sampled[i] and asked for num_logprobs[i] top logprobs (a row id
        repeats, in order, for each token it emitted); get() hands the sampled ids to on_host
        (the runner's rows record them), then the new tokens by request to `propose`, whose
        drafts it returns too."""
        self.on_host = on_host
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
        return RunnerOutput(sampled, logprobs, prompt, drafts)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A pinned host tensor that a non_blocking copy from `t` fills in stream order."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
