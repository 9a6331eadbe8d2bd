"""DraftModelStep: the draft model's forward for spec_decode/draft_model.py, on the runner's
inputs.

The draft's paged KV cache has the target's block ids, block size and number of blocks (other
tensors, its own layer count and head shape; or the target's tensors for a self-draft): a step
of the draft reads a request's block table from the runner's persistent batch, as the target's
steps do, and a block copy (copy-on-write) copies the draft's blocks too. The draft runs on the
target's kernel backend. The engine sizes the blocks for both (EngineCore._num_blocks).
Draft steps reuse the runner's InputBuffers: they run when the target's step is done (its
results on the host), before the next step is prepared.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from pagoda.kernels.paged_cache import KVCache
from pagoda.layers.forward_context import forward_context
from pagoda.layers.kv_cache import allocate_kv_caches
from pagoda.loading.draft import DraftModel
from pagoda.runner.draft_sampling import DraftSampler
from pagoda.runner.input_batch import InputBatch
from pagoda.runner.speculative import one_token_rows
from pagoda.runner.step_inputs import InputBuffers

if TYPE_CHECKING:
    from pagoda.runner.compilation import CompiledDecode

# Where decode steps are compiled, a step whose rows feed at most this many tokens each (the
# catch-up after a verification: the target's token, and the last draft when all were
# accepted) runs compiled, as one-token rows (speculative.one_token_rows); a longer catch-up (a
# prompt) runs as a prefill. Eager, the prefill path is as fast.
ONE_TOKEN_ROWS_MAX = 8


class DraftModelStep:
    """One forward of the draft over some requests' tokens; a DraftStepFn."""

    def __init__(
        self,
        draft: DraftModel,
        batch: InputBatch,
        buffers: InputBuffers,
        block_size: int,
        device: torch.device,
        kv_dtype: torch.dtype | None,
        compiled: CompiledDecode | None = None,
    ) -> None:
        """compiled: the draft's torch.compile'd decode step (CPU, -O1 and above), for its
        steps of one token per request, as the target's (runner/compilation.py)."""
        self.model = draft.model
        self.shares_target_kv = draft.shares_target_kv
        self.compiled = compiled
        self.config = draft.config
        self.batch = batch
        self.buffers = buffers
        self.block_size = block_size
        self.device = device
        self.kv_dtype = kv_dtype
        self.kv_caches: list[KVCache] = []
        self.sampler: DraftSampler | None = None  # None: greedy drafts (the argmax)

    def allocate(self, num_blocks: int, target_caches: list[KVCache]) -> None:
        """The draft's KV cache: num_blocks blocks, the target's count; or the target's caches
        themselves for a draft that shares them (loading/draft.py)."""
        if self.shares_target_kv:
            self.kv_caches = target_caches
            return
        self.kv_caches = allocate_kv_caches(
            self.config, num_blocks, self.block_size, self.kv_dtype, self.device
        )

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if self.shares_target_kv:
            return  # the runner copied them
        for cache in self.kv_caches:
            cache.copy_blocks(src, dst)

    @torch.inference_mode()
    def __call__(self, rows: list[tuple[str, list[int], int]]) -> list[int]:
        """Feed each row's tokens at its positions (request id, tokens, first position) and
        return each row's token after its last: the argmax, or the sampler's pick (a draft
        sampled as the target samples; runner/draft_sampling.py). The rows' blocks must cover
        them."""
        rids = [rid for rid, _, _ in rows]
        token_ids = [tokens for _, tokens, _ in rows]
        seq_lens = [start + len(tokens) for _, tokens, start in rows]
        last = list(itertools.accumulate(len(t) for t in token_ids))
        num_tokens = last[-1]
        if self.compiled is not None and len(rows) < num_tokens <= self.buffers.max_reqs:
            if max(len(t) for t in token_ids) <= ONE_TOKEN_ROWS_MAX:
                starts = [start for _, _, start in rows]
                rids, token_ids, seq_lens = one_token_rows(rids, token_ids, starts)
        tables = self.batch.block_tables(rids, seq_lens, self.block_size)
        ids, pos, meta = self.buffers.prepare(token_ids, seq_lens, tables, self.block_size)
        with forward_context(meta, self.kv_caches) as ctx:
            if self.compiled is not None and len(token_ids) == num_tokens:
                hidden = self.compiled(ids, pos, ctx)
            else:
                hidden = self.model(ids, pos)  # (num_tokens, hidden_size)
        last = [end - 1 for end in last]
        if last != list(range(len(rows))):
            hidden = hidden.index_select(0, self.buffers.row_index(last))
        logits = self.model.compute_logits(hidden, float32=False)
        if self.sampler is None:
            return logits.argmax(dim=-1).tolist()
        return self.sampler.pick([(rid, start + len(t)) for rid, t, start in rows], logits)
