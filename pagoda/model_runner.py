"""SchedulerOutput -> flat tensors -> forward -> logits -> sample -> RunnerOutput.

The model runner owns every device tensor: weights, the paged KV cache, per-request generators.
"""

from __future__ import annotations

import torch

from pagoda.config import ModelConfig
from pagoda.forward_context import build_attention_metadata, forward_context
from pagoda.layers.attention import KVCache
from pagoda.models.llama import LlamaForCausalLM
from pagoda.sampling import LogprobsTensors, Sampler, SamplingMetadata
from pagoda.scheduler import LogprobEntry, RunnerOutput, ScheduledRequest, SchedulerOutput


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        eos_token_ids: frozenset[int],
        kv_quant_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = sorted(eos_token_ids)
        # One per layer; kv_quant_dtype (CacheConfig.kv_quant_dtype) None keeps the model dtype.
        self.kv_caches = [
            KVCache.allocate(
                num_blocks,
                block_size,
                model_config.num_kv_heads,
                model_config.head_dim,
                model_config.dtype,
                kv_quant_dtype,
                device,
            )
            for _ in range(model_config.num_layers)
        ]
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        for rid in out.finished_request_ids:
            self.generators.pop(rid, None)
        self._copy_blocks(out.block_copies)
        if out.is_empty:
            return RunnerOutput({}, {}, {})

        input_ids: list[int] = []
        positions: list[int] = []
        for s in out.scheduled:
            input_ids.extend(s.token_ids)
            positions.extend(range(s.start, s.start + len(s.token_ids)))
        meta = build_attention_metadata(
            query_lens=[len(s.token_ids) for s in out.scheduled],
            seq_lens=[s.start + len(s.token_ids) for s in out.scheduled],
            block_tables=[s.block_ids for s in out.scheduled],
            block_size=self.block_size,
            device=self.device,
        )
        ids_t = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=self.device)
        with forward_context(meta, self.kv_caches):
            hidden = self.model(ids_t, pos_t)  # (num_tokens, hidden_size)

        prompt_logprobs = self._prompt_logprobs(out.scheduled, hidden)
        sampled, logprobs = self._sample(out.scheduled, hidden)
        return RunnerOutput(sampled, logprobs, prompt_logprobs)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for cache in self.kv_caches:
            cache.copy_blocks(src, dst)

    def _sample(
        self, scheduled: list[ScheduledRequest], hidden: torch.Tensor
    ) -> tuple[dict[str, int], dict[str, LogprobEntry]]:
        rows: list[int] = []
        row_ids: list[str] = []
        params, outputs, prompts, banned = [], [], [], []
        generators: dict[int, torch.Generator] = {}
        token_end = 0
        for s in scheduled:
            token_end += len(s.token_ids)
            for rid, index in zip(s.sample_ids, s.sample_indices):
                is_self = rid == s.request_id
                p = s.sampling_params
                gen = self._generator(rid, p.seed, index)
                if gen is not None:
                    generators[len(rows)] = gen
                rows.append(token_end - 1)
                row_ids.append(rid)
                params.append(p)
                out_ids = s.output_token_ids if is_self else []
                outputs.append(out_ids)
                prompts.append(s.prompt_token_ids)
                banned.append(self._banned(p.min_tokens, p.stop_token_ids, len(out_ids)))
        if not rows:
            return {}, {}
        logits = self.model.compute_logits(hidden[rows])  # (num_rows, vocab) float32
        meta = SamplingMetadata.from_rows(
            params, outputs, prompts, generators, banned, logits.shape[-1], self.device
        )
        result = self.sampler(logits, meta)
        tokens = result.sampled_token_ids.tolist()
        sampled = dict(zip(row_ids, tokens))
        logprobs: dict[str, LogprobEntry] = {}
        if result.logprobs is not None:
            entries = _logprob_entries(result.logprobs)
            for rid, p, entry in zip(row_ids, params, entries):
                if p.logprobs is not None:
                    logprobs[rid] = (
                        entry[0][: p.logprobs + 1],
                        entry[1][: p.logprobs + 1],
                        entry[2],
                    )
        return sampled, logprobs

    def _banned(self, min_tokens: int, stop_token_ids: tuple[int, ...], num_out: int) -> list[int]:
        if num_out >= min_tokens:
            return []
        return [*self.eos_token_ids, *stop_token_ids]

    def _generator(self, rid: str, seed: int | None, index: int) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self.generators.get(rid)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed + index)
            self.generators[rid] = gen
        return gen

    def _prompt_logprobs(
        self, scheduled: list[ScheduledRequest], hidden: torch.Tensor
    ) -> dict[str, list[LogprobEntry]]:
        result: dict[str, list[LogprobEntry]] = {}
        token_start = 0
        for s in scheduled:
            n = s.num_prompt_logprob_tokens
            if n:
                k = s.sampling_params.prompt_logprobs or 0
                row = token_start + s.prompt_logprob_offset
                logits = self.model.compute_logits(hidden[row : row + n])
                first = s.start + s.prompt_logprob_offset + 1
                targets = torch.tensor(s.prompt_token_ids[first : first + n], device=self.device)
                result[s.request_id] = _logprob_entries(
                    self.sampler.compute_logprobs_for(logits, targets, k)
                )
            token_start += len(s.token_ids)
        return result


def _logprob_entries(t: LogprobsTensors) -> list[LogprobEntry]:
    return list(zip(*t.tolists()))
