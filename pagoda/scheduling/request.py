"""Request: the engine's per-sequence state, plain integers and lists (no tensors).

Catch-up invariant: `num_computed_tokens <= num_tokens + num_output_placeholders`; each step
schedules some of the tokens whose KV is still missing. A request samples a new token exactly in
the step in which it catches up. `num_output_placeholders` counts tokens that scheduled steps
will sample but whose ids the host does not know yet: it is 1 from the schedule() of a sampling
step until that step's update(). With async scheduling the next step is scheduled in between,
so its input is that unknown token (PLACEHOLDER_TOKEN_ID; the model runner takes it from the
device).
"""

from __future__ import annotations

import enum
import time

from pagoda.lora_request import LoRARequest
from pagoda.sampling_params import SamplingParams
from pagoda.scheduling.messages import EngineCoreOutput, LogprobEntry


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_FORK = enum.auto()  # an n > 1 sibling waiting for its leader's prompt
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # The engine could not go on with the sample (its grammar refused a sampled token): the
    # client gets an error, never a normal end with a cut output.
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        eos_token_ids: frozenset[int],
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        parent_id: str | None = None,
        sample_index: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        self.lora_id = 0 if lora_request is None else lora_request.lora_int_id
        # What the first block's hash adds to its tokens: two salts or adapters share nothing.
        lora_key = None if lora_request is None else lora_request.cache_key
        keys = [k for k in (cache_salt, lora_key) if k is not None]
        self.hash_extra = "\x1f".join(keys) if keys else None
        # n > 1: every sample is a Request; siblings share the leader's prompt blocks.
        self.parent_id = parent_id if parent_id is not None else request_id
        self.sample_index = sample_index
        self.siblings: list[Request] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        # Speculative decoding: tokens proposed for the next step (the runner's, after a step
        # that sampled); scheduled after the request's last token, verified, then cleared.
        self.spec_token_ids: list[int] = []
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_prompt_logprobs_done = 0  # prompt positions whose logprobs were reported
        self.first_scheduled_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Tokens the request will have once its scheduled steps are updated: the target that
        num_computed_tokens catches up with."""
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, placeholders={self.num_output_placeholders})"
        )

    def output(
        self,
        tokens: list[int],
        logprobs: list[LogprobEntry],
        prompt_logprobs: list[LogprobEntry],
        pooled: bytes | None = None,
    ) -> EngineCoreOutput:
        """What the client hears of this request after a step: its new tokens and state."""
        return EngineCoreOutput(
            request_id=self.request_id,
            new_token_ids=tokens,
            new_logprobs=logprobs,
            new_prompt_logprobs=prompt_logprobs,
            finish_reason=self.status.finish_reason,
            stop_reason=self.stop_reason,
            num_cached_tokens=max(self.num_cached_tokens, 0),
            first_scheduled_time=self.first_scheduled_time,
            parent_id=self.parent_id,
            sample_index=self.sample_index,
            pooled=pooled,
        )
