"""The contract: what enters the engine, what the scheduler tells the runner, what the runner
and the engine answer. msgspec Structs of plain data (no tensors, no torch): they cross a
process boundary as they are (msgpack), with no hand-written conversion.

    client --EngineInput--> EngineCore --SchedulerOutput--> ModelRunner
    client <--EngineCoreOutput-- EngineCore <--RunnerOutput-- ModelRunner
"""

from __future__ import annotations

from typing import Any

import msgspec

from pagoda.lora_request import LoRARequest
from pagoda.sampling_params import SamplingParams

# The input of a position whose token an in-flight step is still sampling.
PLACEHOLDER_TOKEN_ID = -1


def sample_request_id(request_id: str, index: int) -> str:
    """Engine id of sample `index` of a user request (the first sample keeps the user's id)."""
    return request_id if index == 0 else f"{request_id}#{index}"


class EngineRequest(msgspec.Struct, tag="add", array_like=True, omit_defaults=True):
    """What a client sends to EngineCore: an already tokenized prompt, validated where it
    enters (SamplingParams validates itself when built; EngineCore.add_request checks the rest
    against the model)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float | None = None
    priority: int = 0  # lower is served first (scheduling_policy="priority"; fcfs ignores it)
    cache_salt: str | None = None
    # vLLM's: {"do_remote_prefill": true, "remote_host": ..., "remote_port": ...} on a
    # kv_consumer fetches the prompt's KV from that producer (engine/remote_prefill.py)
    kv_transfer_params: dict[str, Any] | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (--enable-lora)

    def __post_init__(self) -> None:
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"priority must be an int, got {self.priority!r}")


class AbortRequest(msgspec.Struct, tag="abort", array_like=True, omit_defaults=True):
    """Abort user requests (every sample of each), or with all_samples=False single samples
    named by their engine ids (a stop string ended one of n)."""

    request_ids: list[str]
    all_samples: bool = True


class WatchRequest(msgspec.Struct, tag="watch", array_like=True):
    """Send an EngineSnapshot at most every interval_s seconds (0: stop; none is built then)."""

    interval_s: float


class LoRAUpdate(msgspec.Struct, tag="lora", array_like=True, omit_defaults=True):
    """Load an adapter (`add`) or remove one (`remove`, its lora_int_id) at run time; the
    engine answers call_id among EngineCoreOutputs' accepted ids or errors."""

    call_id: str
    add: LoRARequest | None = None
    remove: int = 0


# What a client sends to the engine process.
EngineInput = EngineRequest | AbortRequest | WatchRequest | LoRAUpdate


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request the runner does not hold: scheduled for the first time, or again after a
    preemption (then `output_token_ids` holds what it sampled before). Sent once; later steps
    carry only CachedRequestData."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    sample_index: int = 0  # its index among the n samples of its user request (seed + index)
    lora_id: int = 0  # its adapter's lora_int_id (runner/lora.py); 0: the base model


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """A change to the block table of a request the runner holds: its block ids from index
    `start` on become `block_ids` (start == the old length: blocks were appended; less: a
    copy-on-write replaced a shared block)."""

    request_id: str
    start: int
    block_ids: list[int]


class ScheduledRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's share of a step, in batch order."""

    request_id: str
    # Inputs of this step: positions [start, start + len). The last one may be
    # PLACEHOLDER_TOKEN_ID: the token the previous step (still in flight) samples.
    token_ids: list[int]
    start: int  # num_computed_tokens before this step
    num_output_tokens: int  # sampled before this step, placeholders included (min_tokens)
    # Requests that sample from this row's logits: the request itself, plus n > 1 siblings on
    # the step its prompt completes. Empty while a prompt chunk does not reach the end.
    sample_ids: list[str] = []
    sample_indices: list[int] = []  # each one's index among the n
    # Rows [offset, offset + num) of this chunk score prompt tokens (prompt_logprobs).
    prompt_logprob_offset: int = 0
    num_prompt_logprob_tokens: int = 0
    # Speculative decoding: the last num_draft_tokens of token_ids are proposed tokens, which
    # the runner verifies: it samples at each of the last num_draft_tokens + 1 positions.
    num_draft_tokens: int = 0


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step tells the runner: new requests whole, known ones as deltas.

    The runner applies, in this order: drop finished and preempted requests, add
    `new_requests`, apply `cached_requests`, copy `block_copies`, run `scheduled`.
    """

    step_id: int  # the scheduler's count of its schedule() calls
    scheduled: list[ScheduledRequest]
    new_requests: list[NewRequestData] = []
    cached_requests: list[CachedRequestData] = []
    block_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write, before the forward
    finished_request_ids: list[str] = []  # since the last step: the runner drops their state
    preempted_request_ids: list[str] = []  # the runner drops their state; they come back new
    # Structured outputs: sample id -> its allowed tokens at each position it samples this
    # step (the next token; with drafts, after each accepted draft too): int32 bitmask rows as
    # bytes (bit t % 32 of word t // 32 set: token t allowed). A position after a draft the
    # grammar refuses has no row (nothing is emitted there); samples without a grammar absent.
    grammar_bitmask: dict[str, list[bytes]] = {}

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


# One position's logprobs: (token ids, logprobs, rank of column 0); column 0 is the sampled or
# scored token, the rest the top-k.
LogprobEntry = tuple[list[int], list[float], int]


# ---- the KV connector: its scheduler side (engine/remote_prefill.py) -> its worker side
# (distributed/kv_transfer.py's KVWorker, in the executor), which holds every block's data
class KVConnectorOps(msgspec.Struct, omit_defaults=True):
    """Which blocks to send or fetch; the worker side copies, the scheduler side decides."""

    # (request id, producer (host, port), prompt block hashes): fetch the longest run held there
    fetches: list[tuple[str, tuple[str, int], list[bytes]]] = []
    # (request id, block ids): write the blocks fetched for it (its first len(ids)) into these
    loads: list[tuple[str, list[int]]] = []
    # (block ids, their hashes): copy these blocks out for decode instances (a finished
    # prompt's), before the blocks can be reused
    saves: list[tuple[list[int], list[bytes]]] = []
    drops: list[str] = []  # fetched blocks no load will write (the request was aborted)
    poll: bool = False  # answer with the fetches finished since the last poll
    wait_s: float = 0.0  # ... waiting up to this long for a first one


class KVFetchDone(msgspec.Struct):
    """Worker side -> scheduler side: a fetch is over; its first num_blocks blocks are held by
    the worker side until a load writes them (or a drop), or it failed after every try."""

    request_id: str
    hashes: list[bytes]
    num_blocks: int
    error: str | None = None


class RunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    # Each sampling request's new tokens: one, or with draft tokens the accepted drafts and
    # the target's token after them (1 to num_draft_tokens + 1).
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[LogprobEntry]]  # one per new token: ids, logprobs, rank
    prompt_logprobs: dict[str, list[LogprobEntry]]
    # Speculative decoding: proposals for each request's next step (none: plain decoding).
    draft_token_ids: dict[str, list[int]] = {}
    # --runner pooling: the vectors of the requests whose prompts ended this step (float32 bytes)
    pooled: dict[str, bytes] = {}


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
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
    # finish_reason "stop" because the sample's grammar ended (structured outputs), not on a
    # stop token: the last token is text like any other.
    grammar_ended: bool = False
    pooled: bytes | None = None  # --runner pooling: the prompt's vector, float32, native order
    # with finish_reason: the sample's timeline (scheduling/explain.py), for explain
    explain: dict[str, Any] | None = None


class SchedulerStats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # Speculative decoding, totals since start: steps that verified drafts (one per request
    # and step), draft tokens verified, drafts accepted; accepted drafts at each position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []
    # Disaggregation, totals since start (distributed/kv_transfer.KVTransferStats); empty
    # without --kv-transfer-config.
    kv_transfer: dict[str, float] = {}
    # Tensor/pipeline-parallel ranks, totals since start: steps and seconds in them, per rank
    # (refreshed at most every second); empty on one rank.
    rank_steps: list[int] = []
    rank_step_seconds: list[float] = []
    # --enable-lora: the adapters (lora_int_id) of the running and of the waiting requests.
    running_lora_ids: list[int] = []
    waiting_lora_ids: list[int] = []


class SnapshotRequest(msgspec.Struct, array_like=True):
    request_id: str
    queue: str  # running | waiting | preempted (waiting to recompute)
    num_computed_tokens: int
    num_tokens: int  # prompt + outputs so far
    priority: int
    num_preemptions: int
    num_cached_tokens: int  # prompt tokens found in the prefix cache (-1: not admitted yet)
    lora_name: str = ""  # the LoRA adapter it runs with ("": the base model)


class EngineSnapshot(msgspec.Struct, array_like=True):
    """The KV block pool and the queues at one moment (scheduling/snapshot.py). Per block:
    state 0 free, 1 free but holding a cached prefix (evictable), 2 held; its ref count; the
    index in `requests` of the first request holding it (-1: none)."""

    time: float
    step_id: int
    block_size: int
    block_state: list[int]
    block_ref_cnt: list[int]
    block_owner: list[int]
    requests: list[SnapshotRequest]  # running in admission order, then waiting in queue order
    num_scheduled_tokens: int  # in the last step
    max_num_batched_tokens: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """Engine process -> client: what happened since the last message."""

    num_inputs: int  # EngineInput messages the engine has read in total
    stats: SchedulerStats | None = None
    outputs: list[EngineCoreOutput] = []
    accepted: list[str] = []
    errors: dict[str, str] = {}  # request id -> why add_request refused it
    fatal: str | None = None  # the engine died of this
    snapshot: EngineSnapshot | None = None  # while a client watches (WatchRequest)


class EngineInfo(msgspec.Struct):
    """Engine process -> client, once, when the engine is ready."""

    pid: int
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    # --runner pooling: the pooler in effect and a Matryoshka model's output sizes
    # (loading/pooling.py: None, not Matryoshka; [], any size)
    pooling_type: str | None = None
    normalize: bool = False
    hidden_size: int = 0
    matryoshka_dimensions: list[int] | None = None
    num_labels: int = 0  # a classifier's labels (its pooled values are their logits); 0: none
