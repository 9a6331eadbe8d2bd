"""EngineCore: add_request / abort_request / step over tokenized requests.

The step loop is three verbs: schedule, execute, update. Clients (LLM, the server) tokenize,
detokenize and group outputs on their side (output_processor.py).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from pagoda.config import EngineConfig
from pagoda.distributed.executor import make_executor
from pagoda.engine.remote_prefill import RemotePrefill
from pagoda.kv_transfer_config import remote_prefill_source
from pagoda.loading.pooling import matryoshka_dimensions
from pagoda.loading.tokenizer import load_tokenizer_for
from pagoda.lora_request import LoRARequest
from pagoda.model_config import SCALED_KV_DTYPES, ModelConfig
from pagoda.runner.device import kernels_name, resolve_device
from pagoda.runner.executor import Executor, StepOutput
from pagoda.scheduling.block_pool import BlockPool
from pagoda.scheduling.kv_cache_manager import KVCacheManager
from pagoda.scheduling.messages import (
    EngineCoreOutput,
    EngineInfo,
    EngineRequest,
    LoRAUpdate,
    SchedulerOutput,
    SchedulerStats,
    sample_request_id,
)
from pagoda.scheduling.request import Request, RequestStatus
from pagoda.scheduling.scheduler import Scheduler
from pagoda.spec_decode.methods import kv_lookahead

if TYPE_CHECKING:
    from pagoda.engine.grammar import StructuredOutputs

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_BYTES = 2 << 30


class EngineCore:
    def __init__(self, config: EngineConfig, load_tokenizer: bool = True) -> None:
        """Without `load_tokenizer` (the engine process: its client tokenizes) `tokenizer` is
        None and only the tokenizer's EOS id is read (runner/builder.py)."""
        config = resolve_device(config)
        self.config = config
        torch.manual_seed(config.seed)
        self.device = torch.device(config.device_type)
        self.block_size = config.cache.block_size
        # One rank in this process, or a worker process per parallel rank (runner/executor.py).
        self.executor: Executor = make_executor(config, load_tokenizer)
        self.eos_token_ids = self.executor.eos_token_ids
        self.model_config: ModelConfig = self.executor.model_config
        model_config = self.model_config
        self.tokenizer: Any = self.executor.tokenizer
        self.num_blocks = self._num_blocks()
        self.executor.allocate_kv_cache(self.num_blocks)
        pool = BlockPool(self.num_blocks, enable_caching=self._prefix_caching())
        self.kv_cache_manager = KVCacheManager(pool, self.block_size)
        lookahead = kv_lookahead(config.speculative_config)  # past a step's tokens
        max_loras = config.max_loras if config.enable_lora else 0
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv_cache_manager,
            model_config.max_model_len,
            lookahead,
            max_loras,
        )
        self.loras: dict[int, LoRARequest] = {}  # the adapters the ranks hold, by lora_int_id
        self.async_scheduling = config.use_async_scheduling
        # Held by step() and by the KV server thread of a producer (remote_prefill.py).
        self.lock = threading.Lock()
        self.remote_prefill: RemotePrefill | None = None
        if config.kv_transfer_config is not None:
            # the KV connector's scheduler side; its worker side is the executor's
            self.remote_prefill = RemotePrefill(
                config.kv_transfer_config, self.executor, self.kv_cache_manager, self.lock
            )
        # Requests with structured outputs (engine/grammar.py), made on the first one.
        self.structured: StructuredOutputs | None = None
        # Async scheduling: the step launched by the last step() call, not yet updated.
        self.in_flight: tuple[SchedulerOutput, StepOutput] | None = None
        self._log_kv_cache()
        self.executor.warm_up_kernels()
        self.executor.capture_cuda_graphs()
        self.executor.compile_decode_step()
        self._log_kernels()

    def _prefix_caching(self) -> bool:
        """--enable-prefix-caching, but off for MEAN and CLS pooling, which read every prompt
        row (runner/pooler.py)."""
        pooler = self.model_config.pooler
        if pooler is not None and pooler.pooling_type != "LAST":
            if self.config.cache.enable_prefix_caching:
                logger.info(
                    "prefix caching is off: %s pooling reads every prompt token",
                    pooler.pooling_type,
                )
            return False
        return self.config.cache.enable_prefix_caching

    def _log_kernels(self) -> None:
        config = self.config
        logger.info(
            "kernels: %s; optimization level %d: decode CUDA graphs %s, compiled decode %s; "
            "async scheduling %s",
            kernels_name(config.kernel_backend, self.device.type),
            config.level,
            "on" if config.use_cuda_graphs else "off",
            ("on, C++ wrapper" if config.decode_cpp_wrapper else "on")
            if config.compile_decode
            else "off",
            "on" if self.async_scheduling else "off",
        )
        if config.speculative_config is not None:
            logger.info("speculative decoding: %s", config.speculative_config.to_dict())

    def _log_kv_cache(self) -> None:
        config, model_config = self.config, self.model_config
        kv_dtype = config.cache.kv_dtype  # a dtype name, None: the model's
        num_tokens = self.num_blocks * self.block_size
        blocks_per_seq = -(-model_config.max_model_len // self.block_size)
        logger.info(
            "KV cache %s (%s%s): %d blocks of %d tokens = %d tokens, %.1f MiB; "
            "max concurrency %.2fx at max_model_len %d",
            config.cache.kv_cache_dtype,
            kv_dtype or model_config.dtype,
            " + a scale per token and kv head" if kv_dtype in SCALED_KV_DTYPES else "",
            self.num_blocks,
            self.block_size,
            num_tokens,
            num_tokens * model_config.kv_bytes_per_token(kv_dtype) / 2**20,
            self.num_blocks / blocks_per_seq,
            model_config.max_model_len,
        )
        if model_config.sliding_window_layers:
            # One block table serves every layer (scheduling/kv_cache_manager.py), so a local
            # layer keeps its blocks behind the window: the sizing above counts the whole context
            # for every layer. Freeing them needs a block table per window kind (vLLM's hybrid
            # KV cache manager), not built.
            logger.info(
                "%d of %d layers attend a sliding window of %s tokens; their KV blocks behind "
                "the window are kept (one block table for all layers) and counted above",
                model_config.sliding_window_layers,
                model_config.num_layers,
                model_config.hf_config.sliding_window,
            )

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len

    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        per_token = self.model_config.kv_bytes_per_token(cache.kv_dtype)
        per_token += self.executor.draft_kv_bytes_per_token(cache.kv_dtype)
        block_bytes = self.block_size * per_token
        budget = cache.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                budget = self.executor.profiled_kv_budget()
            else:
                budget = CPU_DEFAULT_KV_CACHE_BYTES
        num = budget // block_bytes
        if num < 1:
            raise ValueError(
                f"KV cache memory of {budget} bytes holds no block of {block_bytes} bytes; "
                "raise --kv-cache-memory-bytes or --gpu-memory-utilization"
            )
        return int(num)

    # ---- the three verbs -------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Schedule, execute, update. With async scheduling the update is of the previous
        step, made while this one runs on the device: outputs arrive one step() later."""
        with self.lock:
            outputs = self._step()
            if self.remote_prefill is not None:
                self.remote_prefill.stage_finished(outputs)
            explainer = self.scheduler.explainer
            for o in outputs:  # a finished sample's timeline rides on its last output
                if o.finish_reason is not None:
                    o.explain = explainer.explain(o.request_id, self.scheduler.step_id)
            return outputs

    def _step(self) -> list[EngineCoreOutput]:
        if self.remote_prefill is not None:
            idle = not self.scheduler.has_unfinished_requests()
            for request in self.remote_prefill.take_ready(idle):
                self.scheduler.add_request(request)
        structured = self.structured
        grammar = structured is not None and structured.active
        failed: list[EngineCoreOutput] = []
        if structured is not None and grammar:
            failed = self._admit_structured(structured)
            if self.in_flight is not None:
                # A grammar's mask needs the step before it updated: async scheduling pauses.
                flushed, pending_output = self.in_flight
                self.in_flight = None
                return failed + self._update(flushed, pending_output.get())
        scheduler_output = self.scheduler.schedule()
        if structured is not None and structured.matchers:
            scheduler_output.grammar_bitmask = structured.bitmasks(scheduler_output.scheduled)
        pending = self.executor.execute(scheduler_output)
        if scheduler_output.is_empty and self.scheduler.waiting and not self.scheduler.running:
            # add_request admits only requests that fit the whole pool, so this is a bug.
            raise RuntimeError("the scheduler made no progress with an idle KV cache")
        if not self.async_scheduling or grammar:
            return failed + self._update(scheduler_output, pending.get())
        previous, self.in_flight = self.in_flight, (scheduler_output, pending)
        if previous is None:
            return []
        return self._update(previous[0], previous[1].get())

    def _update(self, out: SchedulerOutput, runner_output: Any) -> list[EngineCoreOutput]:
        """The scheduler's update, and the grammars advanced: a sample whose grammar has ended
        finishes here, with finish_reason "stop" and no token past the grammar's end; one whose
        grammar refused a token finishes with "error", without that token."""
        outputs = self.scheduler.update(out, runner_output)
        structured = self.structured
        if structured is None or not structured.matchers:
            return outputs
        ended, broken = structured.accept(outputs)
        for cuts, status in (
            (ended, RequestStatus.FINISHED_STOPPED),
            (broken, RequestStatus.FINISHED_ERROR),
        ):
            if cuts:
                self._finish_cut(outputs, cuts, status)
        structured.sweep()
        return outputs

    def _finish_cut(
        self, outputs: list[EngineCoreOutput], cuts: dict[str, int], status: RequestStatus
    ) -> None:
        """Finish the samples of `cuts` with `status`, each output keeping its first new tokens."""
        self.scheduler.finish_requests(cuts, status, all_samples=False)
        for o in outputs:
            keep = cuts.get(o.request_id)
            if keep is not None:
                o.new_token_ids, o.new_logprobs = o.new_token_ids[:keep], o.new_logprobs[:keep]
                o.finish_reason = status.finish_reason
                o.stop_reason = None
                o.grammar_ended = True

    def _admit_structured(self, structured: StructuredOutputs) -> list[EngineCoreOutput]:
        """Queue the requests whose grammar is compiled; those whose grammar failed end as
        aborted (logged). With nothing else to run, wait a little for a grammar."""
        idle = not self.scheduler.has_unfinished_requests()
        ready, failed = structured.take_ready(wait_s=0.05 if idle else 0.0)
        for leader in ready:
            self.scheduler.add_request(leader)
        outputs = []
        for leader, why in failed:
            logger.error("request %s: its grammar failed to compile: %s", leader.parent_id, why)
            for sample in (leader, *leader.siblings):
                outputs.append(
                    EngineCoreOutput(
                        request_id=sample.request_id,
                        new_token_ids=[],
                        new_logprobs=[],
                        new_prompt_logprobs=[],
                        finish_reason=RequestStatus.FINISHED_ABORTED.finish_reason,
                        parent_id=sample.parent_id,
                        sample_index=sample.sample_index,
                    )
                )
        return outputs

    def _structured_outputs(self) -> StructuredOutputs:
        if self.structured is None:
            from pagoda.engine.grammar import GrammarCompiler, StructuredOutputs

            def tokenizer() -> Any:
                return self.tokenizer or load_tokenizer_for(self.config)

            vocab = self.model_config.vocab_size
            compiler = GrammarCompiler(tokenizer, vocab, self.eos_token_ids)
            self.structured = StructuredOutputs(compiler, vocab)
            self.executor.set_draft_grammar(self.structured.draft_mask)
        return self.structured

    def check_health(self) -> None:
        """RuntimeError if a worker rank has died (the engine cannot step on)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the worker ranks, if any (they also stop when this process exits), and the KV
        transfer threads."""
        if self.remote_prefill is not None:
            self.remote_prefill.close()
        if self.structured is not None:
            self.structured.compiler.shutdown()
        self.executor.shutdown()

    def has_unfinished_requests(self) -> bool:
        waiting = 0 if self.remote_prefill is None else self.remote_prefill.num_waiting
        if self.structured is not None:
            waiting += len(self.structured.pending)
        return waiting > 0 or self.scheduler.has_unfinished_requests()

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort user requests (every sample of an n > 1 request); unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        with self.lock:
            if self.remote_prefill is not None:
                self.remote_prefill.abort(request_ids)
            if self.structured is not None:
                self.structured.abort(request_ids)
            self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def abort_sample(self, engine_request_id: str) -> None:
        """Abort one sample (e.g. its stop string was found by the client)."""
        with self.lock:
            self.scheduler.finish_requests(
                [engine_request_id], RequestStatus.FINISHED_ABORTED, all_samples=False
            )

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        if self.remote_prefill is not None:
            stats = msgspec.structs.replace(stats, kv_transfer=self.remote_prefill.stats_dict())
        totals = self.executor.step_totals()
        if totals is not None:
            steps, seconds = totals
            stats = msgspec.structs.replace(stats, rank_steps=steps, rank_step_seconds=seconds)
        return stats

    # ---- admission -------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        """Queue a request the client has checked (client/validation.py: the engine trusts the
        contract); ValueError only for a request id already in use, or a LoRA adapter the
        engine cannot take (add_lora)."""
        self._check_id_free(req.request_id)
        if req.lora_request is not None:
            self.add_lora(req.lora_request)
        params = req.sampling_params
        max_tokens = 1 if self.model_config.pooler is not None else params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(req.prompt_token_ids)
        first = self._samples(req, max_tokens)
        if params.structured_outputs is not None:
            # Queued once its grammar is compiled (a worker thread compiles it).
            self._structured_outputs().add(first)
            return
        source = remote_prefill_source(req.kv_transfer_params)
        kv = self.config.kv_transfer_config
        if source is not None and self.remote_prefill is not None and kv and kv.is_consumer:
            self.remote_prefill.add(first, source)
            return
        asked = req.kv_transfer_params or {}
        if (
            self.remote_prefill is not None
            and kv
            and kv.is_producer
            and asked.get("do_remote_decode")
        ):
            self.remote_prefill.expect_remote_decode(first)
        self.scheduler.add_request(first)

    def add_lora(self, request: LoRARequest) -> None:
        """Load an adapter on the ranks (once per lora_int_id); ValueError when LoRA is off,
        the id names another adapter, or the adapter does not fit the model."""
        if not self.config.enable_lora:
            raise ValueError("LoRA is not enabled: start the engine with --enable-lora")
        known = self.loras.get(request.lora_int_id)
        if known == request:
            return
        if known is not None:
            raise ValueError(
                f"lora_int_id {request.lora_int_id} is adapter {known.lora_name!r} "
                f"({known.lora_path}); remove it first"
            )
        self.executor.add_lora(request)
        self.loras[request.lora_int_id] = request

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter; its running requests finish with it (their rows keep the slot
        until they end). False when no adapter has that id."""
        if self.loras.pop(lora_id, None) is None:
            return False
        return self.executor.remove_lora(lora_id)

    def update_lora(self, update: LoRAUpdate) -> None:
        """A client's runtime load or unload (ValueError: the adapter does not fit, or no
        adapter has that id)."""
        if update.add is not None:
            self.add_lora(update.add)
        elif not self.remove_lora(update.remove):
            raise ValueError(f"no LoRA adapter has lora_int_id {update.remove}")

    def _check_id_free(self, request_id: str) -> None:
        held = self.remote_prefill is not None and self.remote_prefill.holds(request_id)
        held = held or (self.structured is not None and self.structured.holds(request_id))
        if held or request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")

    def info(self) -> EngineInfo:
        """What a client checks requests against (client/validation.py)."""
        return EngineInfo(
            pid=os.getpid(),
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            **self._pooling_info(),
        )

    def _pooling_info(self) -> dict[str, Any]:
        pooler, hf_config = self.model_config.pooler, self.model_config.hf_config
        classifier = self.model_config.classifier
        if pooler is None:
            return {}
        return dict(
            pooling_type=pooler.pooling_type,
            normalize=bool(pooler.normalize),
            hidden_size=int(hf_config.hidden_size),
            matryoshka_dimensions=matryoshka_dimensions(hf_config),
            num_labels=0 if classifier is None else classifier.num_labels,
        )

    def _samples(self, req: EngineRequest, max_tokens: int) -> Request:
        """The request's first sample, its n - 1 siblings attached (they share its blocks)."""
        requests = [
            Request(
                request_id=sample_request_id(req.request_id, i),
                prompt_token_ids=list(req.prompt_token_ids),
                sampling_params=req.sampling_params,
                max_tokens=max_tokens,
                eos_token_ids=self.eos_token_ids,
                arrival_time=req.arrival_time,
                priority=req.priority,
                cache_salt=req.cache_salt,
                parent_id=req.request_id,
                lora_request=req.lora_request,
                sample_index=i,
            )
            for i in range(req.sampling_params.n)
        ]
        requests[0].siblings = requests[1:]
        return requests[0]
