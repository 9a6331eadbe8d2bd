"""The contract: what enters the engine, what the scheduler tells the runner, what the runner
and the engine answer. Plain data only (no tensors, no torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.sampling_params import SamplingParams

# The input of a position whose token an in-flight step is still sampling.
PLACEHOLDER_TOKEN_ID = -1


def sample_request_id(request_id: str, index: int) -> str:
    """Engine id of sample `index` of a user request (the first sample keeps the user's id)."""
    return request_id if index == 0 else f"{request_id}#{index}"


@dataclass
class EngineRequest:
    """What a client sends to EngineCore: an already tokenized prompt."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float | None = None
    priority: int = 0  # lower is served first (scheduling_policy="priority"; fcfs ignores it)
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"priority must be an int, got {self.priority!r}")


@dataclass
class ScheduledRequest:
    request_id: str
    # Inputs of this step: positions [start, start + len). The last one may be
    # PLACEHOLDER_TOKEN_ID: the token the previous step (still in flight) samples.
    token_ids: list[int]
    start: int  # num_computed_tokens before this step
    block_ids: list[int]
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the known outputs (a live list; it lacks a placeholder's)
    num_output_tokens: int  # sampled before this step, placeholders included (min_tokens)
    # Requests that sample from this row's logits: the request itself, plus n > 1 siblings on
    # the step its prompt completes. Empty while a prompt chunk does not reach the end.
    sample_ids: list[str] = field(default_factory=list)
    sample_indices: list[int] = field(default_factory=list)  # each one's index among the n
    # Rows [offset, offset + num) of this chunk score prompt tokens (prompt_logprobs).
    prompt_logprob_offset: int = 0
    num_prompt_logprob_tokens: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    block_copies: list[tuple[int, int]]  # (src, dst) copy-on-write, before the forward pass
    finished_request_ids: list[str]  # since the last step: the runner drops their state
    preempted_request_ids: list[str]
    step_id: int = 0  # the scheduler's count of its schedule() calls

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


# One position's logprobs: (token ids, logprobs, rank of column 0); column 0 is the sampled or
# scored token, the rest the top-k.
LogprobEntry = tuple[list[int], list[float], int]


@dataclass
class RunnerOutput:
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, LogprobEntry]  # ids, logprobs (col 0 = sampled), rank
    prompt_logprobs: dict[str, list[LogprobEntry]]


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobEntry]
    new_prompt_logprobs: list[LogprobEntry]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    parent_id: str = ""
    sample_index: int = 0


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
