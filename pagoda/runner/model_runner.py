"""SchedulerOutput -> flat tensors -> forward -> logits -> sample -> RunnerOutput.

The model runner owns every device tensor: weights, the paged KV cache, the persistent step
inputs (forward_context.InputBuffers), CUDA graphs and their outputs, per-request generators,
and the previous step's sampled ids.

execute() only launches work: it returns a PendingOutput whose host copies are queued behind the
step, and whose get() is the step's one host sync. Under async scheduling the engine launches
the next step before that get(); a request decoding from a placeholder input then reads the
token the previous step sampled straight from the device (pending_output.fill_placeholders).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pagoda.kernels.paged_cache import KVCache
from pagoda.layers.forward_context import AttentionMetadata, forward_context
from pagoda.layers.kv_cache import allocate_kv_caches
from pagoda.layers.parallel import NO_CONTEXT_PARALLEL, WHOLE_MODEL, ContextParallel, PipelineStage
from pagoda.layers.quant_forms import triton_weights
from pagoda.loading.draft import DraftModel
from pagoda.model_config import ModelConfig
from pagoda.models.interface import CausalLM
from pagoda.runner.context_parallel import context_parallel_forward
from pagoda.runner.cuda_graphs import (
    LOGITS_IN_GRAPH_MAX,
    DecodeGraphs,
    DecodeOutput,
    capture_sizes,
    padded_size,
)
from pagoda.runner.device import keep_freed_host_memory, to_device
from pagoda.runner.draft_sampling import DraftSampler
from pagoda.runner.draft_step import DraftModelStep
from pagoda.runner.grammar_mask import apply_grammar_bitmask
from pagoda.runner.input_batch import BatchColumns, InputBatch, SamplingRows
from pagoda.runner.kernel_warmup import decode_split_counts, matmul_row_counts, prefill_lens
from pagoda.runner.pending_output import PendingOutput, fill_placeholders
from pagoda.runner.pipeline import StageTimeline, pipelined_forward
from pagoda.runner.pooler import Pooler
from pagoda.runner.prompt_logprobs import compute_prompt_logprobs
from pagoda.runner.sampler import LogprobsTensors, Sampler, SamplingMetadata
from pagoda.runner.speculative import (
    DraftProposer,
    draft_positions,
    one_token_rows,
    verify_drafts,
)
from pagoda.runner.step_inputs import InputBuffers
from pagoda.scheduling.messages import ScheduledRequest, SchedulerOutput
from pagoda.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    from pagoda.runner.compilation import CompiledDecode
    from pagoda.runner.lora import LoRATable


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        model_config: ModelConfig,
        block_size: int,
        device: torch.device,
        eos_token_ids: frozenset[int],
        kv_dtype: torch.dtype | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        kernel_backend: str = "torch",
        use_cuda_graphs: bool = False,
        compile_decode: bool = False,
        decode_cpp_wrapper: bool = False,
        speculative_config: SpeculativeConfig | None = None,
        draft: DraftModel | None = None,
        pp: PipelineStage = WHOLE_MODEL,
        cp: ContextParallel = NO_CONTEXT_PARALLEL,
    ) -> None:
        """kernel_backend: "torch" (reference) or "triton". use_cuda_graphs: replay graphs for
        pure-decode batches (CUDA, triton). compile_decode: pure-decode batches through
        torch.compile (runner/compilation.py), from inductor's C++ wrapper with decode_cpp_wrapper.
        speculative_config: propose drafts and verify them (runner/speculative.py; sync
        scheduling). draft: method draft_model's model (runner/draft_step.py). pp: the pipeline
        stage, its steps as micro-batches (runner/pipeline.py). cp: the prefill-context-parallel
        rank, which computes its share of each step's rows (runner/context_parallel.py)."""
        self.model = model
        self.pp, self.cp = pp, cp
        self.model_config = model_config
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = sorted(eos_token_ids)
        self.kv_dtype = kv_dtype  # CacheConfig.kv_dtype; None: model dtype
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.kernel_backend = kernel_backend
        self.use_cuda_graphs = use_cuda_graphs
        if model is not None:
            model.set_kernel_backend(kernel_backend)
        self.max_blocks_per_seq = -(-model_config.max_model_len // block_size)
        self._init_step_state()
        self.kv_caches: list[KVCache] = []  # one per layer, from allocate_kv_cache
        # Pure-decode batches are padded to these sizes (the graphs' sizes); setting them
        # without graphs runs the padded batches eagerly, the reference of a replay.
        self.decode_sizes = capture_sizes(max_num_seqs) if use_cuda_graphs else None
        self.graphs: DecodeGraphs | None = None
        self.compiled = _compiled_decode(model, decode_cpp_wrapper) if compile_decode else None
        self.pooler: Pooler | None = None  # --runner pooling (runner/builder.py sets it)
        self.lora: LoRATable | None = None  # --enable-lora (runner/builder.py sets it)
        self.draft_step: DraftModelStep | None = None
        if draft is not None:
            self.draft_step = self._draft_step(draft, compile_decode, decode_cpp_wrapper)
        self.proposer: DraftProposer | None = None
        if speculative_config is not None:
            shares_kv = draft is not None and draft.shares_target_kv
            self.proposer = DraftProposer(
                speculative_config, model_config.max_model_len, self.draft_step,
                self.buffers.max_tokens, shares_kv, self.device.type,
            )  # fmt: skip

    def _init_step_state(self) -> None:
        """The step buffers, the persistent rows and what steps hand on to the next."""
        self.buffers = InputBuffers(
            max(self.max_num_batched_tokens, self.max_num_seqs),
            self.max_num_seqs,
            self.max_blocks_per_seq,
            self.device,
        )
        self.sampler = Sampler()
        self.num_micro_batches = max(2, self.pp.size)  # a pipeline stage's step
        self.stage_timeline = StageTimeline()
        vocab = self.model_config.vocab_size
        rows = max(64, self.max_num_seqs)
        self.batch = InputBatch(vocab, rows, self.device, self.max_blocks_per_seq)
        self.generators: dict[str, torch.Generator] = {}
        self._sampling_columns: tuple[tuple[int, tuple[str, ...]], BatchColumns] | None = None
        # The last executed step's sampled ids (R,) on the device, and each sampling request's
        # row in them: the inputs of the next step's placeholders.
        self.prev_sampled: torch.Tensor | None = None
        self.prev_rows: dict[str, int] = {}
        self.grammar_bitmask: dict[str, list[bytes]] = {}  # this step's (runner/grammar_mask.py)

    def _draft_step(
        self, draft: DraftModel, compile_decode: bool, cpp_wrapper: bool
    ) -> DraftModelStep:
        """The draft model's forward over this runner's rows and buffers."""
        draft.model.set_kernel_backend(self.kernel_backend)
        compiled = _compiled_decode(draft.model, cpp_wrapper) if compile_decode else None
        args = (self.batch, self.buffers, self.block_size, self.device, self.kv_dtype)
        step = DraftModelStep(draft, *args, compiled)
        step.sampler = DraftSampler(self.batch, self.generators, self.device, self.eos_token_ids)
        return step

    def _allocate_caches(self, num_blocks: int) -> list[KVCache]:
        block_size = self.block_size // self.cp.size  # a rank's share of each block
        return allocate_kv_caches(
            self.model_config, num_blocks, block_size, self.kv_dtype, self.device
        )

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = self._allocate_caches(num_blocks)
        if self.draft_step is not None:
            self.draft_step.allocate(num_blocks, self.kv_caches)
        if self.device.type == "cpu":
            keep_freed_host_memory()  # after the cache (mapped apart), before any step

    def capture_cuda_graphs(self) -> None:
        """After allocate_kv_cache: capture the decode graphs when they are enabled."""
        if self.decode_sizes is not None and self.use_cuda_graphs:
            self.graphs = DecodeGraphs(
                self.decode_body,
                self.kv_caches,
                self.buffers,
                self.block_size,
                self.decode_sizes,
                self.decode_num_splits,
            )
            self.graphs.capture()

    @torch.inference_mode()
    def compile_decode_step(self) -> None:
        """After allocate_kv_cache, when decode steps are compiled: compile the graphs now
        (CompiledDecode.compile_now), the draft model's too."""
        compiled = [(self.compiled, self.kv_caches)]
        if self.draft_step is not None:
            compiled.append((self.draft_step.compiled, self.draft_step.kv_caches))
        from pagoda.runner.compilation import StepLimits

        max_len = self.model_config.max_model_len
        limits = StepLimits(self.max_num_seqs, self.max_blocks_per_seq, max_len)
        for graphs, caches in compiled:
            if graphs is not None:
                graphs.compile_now(caches, self.buffers, self.block_size, limits)

    @torch.inference_mode()
    def warm_up_kernels(self) -> None:
        """After allocate_kv_cache, with the triton backend: steps that launch each kernel
        variant a served step can need (runner/kernel_warmup.py), so that Triton compiles none
        while serving. This writes keys and values into blocks that no request holds yet and
        every request overwrites before reading."""
        if self.kernel_backend != "triton":
            return
        for splits in decode_split_counts(self.max_num_seqs, self.decode_num_splits):
            self._dummy_step([1], self.kv_caches, splits)
        max_len, max_rows = self.model_config.max_model_len, self.max_num_seqs
        # Matmuls have variants only where integer weights run Triton's kernels.
        quantized = triton_weights(self.device)
        max_tokens = max(self.max_num_batched_tokens, max_rows) if quantized else 2
        for num_tokens in matmul_row_counts(2, max_tokens):
            hidden = self._dummy_step(prefill_lens(num_tokens, max_len, max_rows), self.kv_caches)
        for rows in matmul_row_counts(1, max_rows if quantized else 1):
            if self.pp.is_last:
                self.model.compute_logits(hidden.new_zeros(rows, hidden.shape[1]))

    def _dummy_step(
        self, query_lens: list[int], caches: list[KVCache], num_splits: int | None = None
    ) -> torch.Tensor:
        """The forward of a step of zeros over `caches`, a request per query length (decodes
        two blocks long, prefills without context; the requests share blocks), with the runner's
        split count unless num_splits is given. Returns the hidden states."""
        max_len = self.model_config.max_model_len
        seq_lens = [min(self.block_size + 1, max_len) if q == 1 else q for q in query_lens]
        num_blocks = caches[0].k.shape[0]
        tables = [[j % num_blocks for j in range(-(-n // self.block_size))] for n in seq_lens]
        if num_splits is None:
            num_splits = self.decode_num_splits(query_lens.count(1))
        ids, pos, meta = self.buffers.prepare(
            [[0] * q for q in query_lens],
            seq_lens,
            tables,
            self.block_size,
            decode_num_splits=num_splits,
        )
        return self._forward(ids, pos, meta, caches)

    def _forward(
        self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata, caches: list[KVCache]
    ) -> torch.Tensor:
        if self.cp.size > 1:
            cp, size = self.cp, self.block_size
            return context_parallel_forward(self.model, ids, pos, meta, caches, cp, size)
        with forward_context(meta, caches):
            return self.model(ids, pos)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """The largest step the scheduler can emit: max_num_batched_tokens prompt tokens (in
        sequences of at most max_model_len), then the LM head and a softmax over max_num_seqs
        rows, on a throwaway KV cache. Sets the activation peak the KV cache must leave free."""
        max_len = self.model_config.max_model_len
        lens = prefill_lens(self.max_num_batched_tokens, max_len, self.max_num_seqs)
        caches = self._allocate_caches(sum(-(-n // self.block_size) for n in lens))
        hidden = self._dummy_step(lens, caches)
        rows = min(self.max_num_seqs, hidden.shape[0])
        if self.pp.is_last:
            torch.softmax(self.model.compute_logits(hidden[:rows]), dim=-1)
        del caches

    def decode_num_splits(self, num_decodes: int) -> int:
        if self.kernel_backend != "triton" or num_decodes == 0:
            return 1
        from pagoda.kernels.attention import decode_num_splits

        return decode_num_splits(
            num_decodes, self.model_config.num_kv_heads_per_rank, self.max_blocks_per_seq
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> PendingOutput:
        """Launch one step: inputs, forward, sampling, and the copies of its results to the host
        (see PendingOutput)."""
        self._apply(out)
        if out.is_empty:
            self.prev_sampled, self.prev_rows = None, {}
            return PendingOutput([], [], None, None, {})

        rids = [s.request_id for s in out.scheduled]
        token_ids = [s.token_ids for s in out.scheduled]
        seq_lens = [s.start + len(s.token_ids) for s in out.scheduled]
        num_tokens = sum(len(t) for t in token_ids)
        if self.pp.size > 1:  # the stages before the last sample nothing
            final = pipelined_forward(self, rids, token_ids, seq_lens)
            if final is None:
                return PendingOutput([], [], None, None, {})
            return self._sample(out.scheduled, final, self._prompt_logprobs(out, final))
        if (
            len(rids) < num_tokens <= self.max_num_seqs
            and (self.compiled is not None or self.decode_sizes is not None)
            and all(len(s.token_ids) == 1 + s.num_draft_tokens for s in out.scheduled)
        ):  # a verification step without prefills runs as a (compiled, graphed) decode step
            starts = [s.start for s in out.scheduled]
            rids, token_ids, seq_lens = one_token_rows(rids, token_ids, starts)
        num_decodes = sum(len(t) == 1 for t in token_ids)
        size = None  # the padded size of a pure-decode batch that runs as a graph's batch
        if self.decode_sizes is not None and num_decodes == num_tokens:
            size = padded_size(self.decode_sizes, num_tokens)
        tables = self.batch.block_tables(rids, seq_lens, self.block_size)
        ids_t, pos_t, meta = self.buffers.prepare(
            token_ids,
            seq_lens,
            tables,
            self.block_size,
            pad_to=size,
            decode_num_splits=self.decode_num_splits(size or num_decodes),
            full_width=size is not None,
        )
        fill_placeholders(out.scheduled, ids_t, self.prev_sampled, self.prev_rows, self.device)
        if self.lora is not None:  # each token's adapter slot
            self.lora.prepare(rids, [len(t) for t in token_ids], size)
        decoded: DecodeOutput | None = None
        if size is not None and self.graphs is not None:
            decoded = self.graphs.replay(size)
        elif size is not None:  # the eager reference of a replay
            with forward_context(meta, self.kv_caches):
                decoded = self.decode_body(ids_t, pos_t)
        elif self.compiled is not None and num_decodes == num_tokens:
            with forward_context(meta, self.kv_caches) as ctx:
                hidden = self.compiled(ids_t, pos_t, ctx)
        else:
            hidden = self._forward(ids_t, pos_t, meta, self.kv_caches)  # (num_tokens, hidden)
        if decoded is not None:
            hidden = decoded.hidden
        hidden = hidden[:num_tokens]
        if self.pooler is not None:
            return self.pooler.pool(out.scheduled, hidden)
        return self._sample(out.scheduled, hidden, self._prompt_logprobs(out, hidden), decoded)

    def _apply(self, out: SchedulerOutput) -> None:
        """The step's deltas to the rows, the proposer, the generators and the blocks."""
        for rid in out.finished_request_ids:
            self.generators.pop(rid, None)
        if self.pooler is not None:
            self.pooler.drop(out.finished_request_ids + out.preempted_request_ids)
        if self.proposer is not None:  # a preempted request's blocks are gone
            for rid in out.finished_request_ids + out.preempted_request_ids:
                self.proposer.remove(rid)
                if self.draft_step is not None and self.draft_step.sampler is not None:
                    self.draft_step.sampler.remove(rid)
        self.batch.apply(out)
        if self.lora is not None:
            self.lora.track(out)
        self._copy_blocks(out.block_copies)
        self.grammar_bitmask = out.grammar_bitmask

    def _prompt_logprobs(
        self, out: SchedulerOutput, hidden: torch.Tensor
    ) -> dict[str, LogprobsTensors]:
        return compute_prompt_logprobs(
            out.scheduled, hidden, self.batch, self.model, self.sampler, self.max_num_seqs
        )

    def decode_body(self, input_ids: torch.Tensor, positions: torch.Tensor) -> DecodeOutput:
        """A padded pure-decode step's device work, what its CUDA graph holds: the forward, and
        for small batches the LM head and its argmax too (cuda_graphs.LOGITS_IN_GRAPH_MAX)."""
        hidden = self.model(input_ids, positions)  # (size, hidden_size)
        if hidden.shape[0] > LOGITS_IN_GRAPH_MAX:
            return DecodeOutput(hidden, None, None)
        logits = self.model.compute_logits(hidden, float32=False)  # (size, vocab)
        return DecodeOutput(hidden, logits, logits.argmax(dim=-1))

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = to_device([c[0] for c in copies], torch.int64, self.device)
        dst = to_device([c[1] for c in copies], torch.int64, self.device)
        for cache in self.kv_caches:
            cache.copy_blocks(src, dst)
        if self.draft_step is not None:
            self.draft_step.copy_blocks(src, dst)

    def _sample(
        self,
        scheduled: list[ScheduledRequest],
        hidden: torch.Tensor,
        prompt_logprobs: dict[str, LogprobsTensors],
        decoded: DecodeOutput | None = None,
    ) -> PendingOutput:
        """Sample every request that catches up this step (and count the samples of rows with
        penalties, on the device, for the steps after this one). decoded: the logits and argmax
        a padded decode step already computed, one row per request in order."""
        rows = SamplingRows()
        token_end = 0
        for s in scheduled:
            token_end += len(s.token_ids)
            if s.sample_ids:
                rows.add(s, self.batch.rows[s.request_id], token_end - 1 - s.num_draft_tokens)
        if not rows.row_ids:
            self.prev_sampled, self.prev_rows = None, {}
            return PendingOutput([], [], None, None, prompt_logprobs)
        if any(s.num_draft_tokens for s in scheduled):
            # each sampling row's draft tokens (n > 1 siblings never have any)
            drafts = [
                s.token_ids[len(s.token_ids) - s.num_draft_tokens :]
                for s in scheduled
                for _ in s.sample_ids
            ]
            return self._sample_drafts(rows, drafts, hidden, prompt_logprobs)
        num_rows = len(rows.flat_rows)
        logits, greedy = self._logits(rows, hidden, decoded)
        if apply_grammar_bitmask(logits, rows.row_ids, self.grammar_bitmask):
            greedy = None
        columns = self._columns(rows)
        meta = SamplingMetadata.from_batch(
            columns,
            self.batch,
            rows,
            rows.generators(self.generators, self.device),
            self.eos_token_ids,
        )
        result = self.sampler(logits, meta, None if greedy is None else greedy[:num_rows])
        self.batch.count_sampled(rows, result.sampled_token_ids)
        self.prev_sampled = result.sampled_token_ids
        self.prev_rows = {rid: i for i, rid in enumerate(rows.row_ids)}
        return PendingOutput(
            rows.row_ids,
            columns.num_logprobs,
            result.sampled_token_ids,
            result.logprobs,
            prompt_logprobs,
            on_host=lambda tokens: self.batch.record_sampled(rows.own_rows, tokens),
            propose=self._propose_fn(),
        )

    def _logits(
        self, rows: SamplingRows, hidden: torch.Tensor, decoded: DecodeOutput | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampling rows' logits (num_rows, vocab) in the model's dtype (the sampler widens
        them in its first pass), and their argmax where a graph's step computed it."""
        # One row per request in a pure-decode step: no gather (and no index upload) needed.
        flat = rows.flat_rows
        in_order = flat == list(range(hidden.shape[0]))
        if in_order and decoded is not None and decoded.logits is not None:
            return decoded.logits[: len(flat)], decoded.greedy
        last = hidden if in_order else hidden.index_select(0, self.buffers.row_index(flat))
        return self.model.compute_logits(last, float32=False), None

    def _sample_drafts(
        self,
        rows: SamplingRows,
        drafts: list[list[int]],
        hidden: torch.Tensor,
        prompt_logprobs: dict[str, LogprobsTensors],
    ) -> PendingOutput:
        """_sample for a step in which some rows verify draft tokens (runner/speculative.py)."""
        assert self.proposer is not None
        positions = draft_positions(rows, drafts)
        last = hidden.index_select(0, self.buffers.row_index(positions.flat_rows))
        logits = self.model.compute_logits(last, float32=False)  # (T, vocab)
        # A grammar sample's positions in order: its masks after each of its drafts.
        apply_grammar_bitmask(logits, positions.row_ids, self.grammar_bitmask)
        columns = BatchColumns.gather(self.batch, positions, self.device)
        generators = positions.generators(self.generators, self.device)
        meta = SamplingMetadata.from_batch(
            columns, self.batch, positions, generators, self.eos_token_ids
        )
        sampler = None if self.draft_step is None else self.draft_step.sampler
        draft_probs = (
            [] if sampler is None else list(map(sampler.draft_probs, rows.row_ids, drafts))
        )
        verified = verify_drafts(self.sampler, logits, meta, rows, drafts, draft_probs)
        self.proposer.record(drafts, rows, verified.counts)
        emitted = verified.emitted_rows
        self.batch.count_sampled(emitted, verified.sampled)
        self.prev_sampled, self.prev_rows = None, {}  # no placeholders: sync scheduling
        num_logprobs = [r.params.logprobs for r in emitted.leaders]
        return PendingOutput(
            emitted.row_ids,
            num_logprobs,
            verified.sampled,
            verified.logprobs,
            prompt_logprobs,
            on_host=lambda tokens: self.batch.record_sampled(emitted.own_rows, tokens),
            propose=self._propose_fn(),
        )

    def _propose_fn(self) -> Callable[[dict[str, list[int]]], dict[str, list[int]]] | None:
        """What PendingOutput.get calls with the step's new tokens (recorded in the rows) to
        propose the next step's drafts; None without speculative decoding."""
        proposer = self.proposer
        if proposer is None:
            return None
        return lambda sampled: proposer.propose(self.batch, sampled)

    def _columns(self, rows: SamplingRows) -> BatchColumns:
        """The sampling rows' columns, gathered again only when the rows or the batch changed."""
        key = (self.batch.version, tuple(rows.row_ids))
        if self._sampling_columns is None or self._sampling_columns[0] != key:
            self._sampling_columns = (key, BatchColumns.gather(self.batch, rows, self.device))
        return self._sampling_columns[1]


def _compiled_decode(model: CausalLM, cpp_wrapper: bool) -> CompiledDecode:
    # Imported here: torch._dynamo takes over a second to import, and only -O1 and above on
    # CPU use it (every engine and server process would pay it otherwise).
    from pagoda.runner.compilation import CompiledDecode

    return CompiledDecode(model, cpp_wrapper)
