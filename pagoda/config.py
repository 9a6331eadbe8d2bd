"""Engine configuration: frozen dataclasses built once from user arguments (vLLM's flag names).

User errors raise ValueError saying what to change; derived values are properties.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from pagoda.kv_transfer_config import KVTransferConfig
from pagoda.model_config import QUANTIZATION_METHODS
from pagoda.pooler_config import (
    RUNNERS,
    PoolerConfig,
    folder_architectures,
    is_classifier,
    parse_hf_overrides,
)
from pagoda.speculative_config import SpeculativeConfig

_DTYPES = ("float32", "bfloat16", "float16")
SCHEDULING_POLICIES = ("fcfs", "priority")
# auto: triton on CUDA, torch on CPU. torch is the reference every kernel is tested against.
ATTENTION_BACKENDS = ("auto", "torch", "triton")


# --kv-cache-dtype values (vLLM's) -> the cache's storage dtype; int8 and float8_e4m3fn rows
# (model_config.SCALED_KV_DTYPES) each beside one KV_SCALE_DTYPE scale per (token, kv head);
# "auto" stores the model dtype.
KV_STORAGE_DTYPES = {
    "bfloat16": "bfloat16",
    "float16": "float16",
    "int8": "int8",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
}
KV_CACHE_DTYPES = ("auto", *KV_STORAGE_DTYPES)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(
                f"block_size must be a power of two in [1, 128], got {self.block_size}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("num_gpu_blocks_override must be >= 1")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be > 0")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                f"got {self.kv_cache_dtype!r}"
            )

    @property
    def kv_dtype(self) -> str | None:
        """The cache's storage dtype name (bfloat16, float16, or int8 / float8_e4m3fn with
        scales); None for auto (the model dtype)."""
        return KV_STORAGE_DTYPES.get(self.kv_cache_dtype)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    policy: str = "fcfs"
    # finished requests whose timelines `explain` keeps (scheduling/explain.py)
    max_explained_requests: int = 256

    def __post_init__(self) -> None:
        if self.max_explained_requests < 0:
            raise ValueError(
                f"max_explained_requests must be >= 0, got {self.max_explained_requests}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Every engine argument, with vLLM's names. `model=None` is the embedded SmolLM2 GGUF."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    device: str = "auto"
    load_format: str = "auto"
    # None: the checkpoint's own (gguf for a GGUF file on CPU, its quantization_config for an
    # HF folder), else none. See layers/quant.py.
    quantization: str | None = None
    trust_remote_code: bool = False
    attention_backend: str = "auto"
    # vLLM's -O: 0 runs every step eagerly; 1-3 replay CUDA graphs for decode batches (CUDA,
    # triton) or run decode steps through torch.compile (CPU; 3 with inductor's C++ wrapper).
    # None: 2 on CUDA, 0 on CPU, where compiling costs up to a minute of startup. enforce_eager
    # forces 0.
    optimization_level: int | None = None
    enforce_eager: bool = False
    # vLLM's async scheduling: step N+1 is scheduled and launched before step N's outputs are
    # processed, so the host's bookkeeping overlaps the device's work. None: on for CUDA, off on
    # CPU (where the host runs the model itself and nothing overlaps).
    async_scheduling: bool | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # No tokenizer: prompts are token ids, outputs carry token ids and empty text (vLLM's flag).
    skip_tokenizer_init: bool = False
    # vLLM's --speculative-config: a SpeculativeConfig, its dict, or its JSON text (parsed here).
    speculative_config: SpeculativeConfig | None = None
    # Ranks that split every layer (layers/parallel.py), each a worker process the engine starts
    # (distributed/workers.py); 1: the model runs in the engine's own process.
    tensor_parallel_size: int = 1
    # Stages the layers are split into (layers/parallel.PipelineStage), each a worker process
    # (times tensor_parallel_size) that runs micro-batches of every step (runner/pipeline.py).
    pipeline_parallel_size: int = 1
    # Ranks that split each step's prompt tokens and hold 1/N of every request's KV cache along
    # the sequence (layers/context_parallel.py), each a worker process with the whole model.
    prefill_context_parallel_size: int = 1
    # vLLM's --kv-transfer-config: prefill/decode disaggregation (kv_transfer_config.py); a
    # KVTransferConfig, its dict or its JSON text (parsed here).
    kv_transfer_config: KVTransferConfig | None = None
    # vLLM's --runner: "pooling" serves embeddings (runner/pooler.py) instead of generating;
    # "auto" pools for a *ForSequenceClassification checkpoint (scores, rerank), else generates.
    runner: str = "auto"
    # vLLM's --pooler-config (pooler_config.py): a PoolerConfig, its dict or its JSON text.
    pooler_config: PoolerConfig | None = None
    # vLLM's --hf-overrides: fields set on the checkpoint's config (a dict or its JSON text).
    hf_overrides: dict[str, Any] | None = None
    # vLLM's LoRA flags: adapters per request (runner/lora.py). max_loras: adapter slots on the
    # device (distinct adapters one step may run); max_lora_rank: the slots' rank (8, 16, 32,
    # 64, 128, 256, 320 or 512 in vLLM; any >= 1 here); max_cpu_loras: adapters kept loaded
    # on the host (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # The adapters' dtype in their slots (vLLM's --lora-dtype): auto is the model's (float32
    # on CPU); bfloat16 or float16 halve the bytes a step reads (pagoda's CPU kernel converts).
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda; got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(
                f"load_format must be auto, safetensors, gguf or dummy; got {self.load_format!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; "
                f"got {self.attention_backend!r}"
            )
        if self.device == "cpu" and self.attention_backend == "triton":
            if os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(
                    "attention_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 to run "
                    "the kernels in Triton's interpreter on CPU, for tests); use 'torch' on CPU"
                )
        if self.optimization_level is not None and self.optimization_level not in range(4):
            raise ValueError(
                f"optimization_level must be 0, 1, 2 or 3; got {self.optimization_level!r}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; "
                f"got {self.quantization!r}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(
                f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}"
            )
        spec = SpeculativeConfig.parse(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        self._check_pipeline(spec)
        self._check_context_parallel(spec)
        self._check_kv_transfer()
        self._check_pooling(spec)
        self._check_lora()
        if spec is not None and self.async_scheduling:
            raise ValueError(
                "async scheduling does not work with speculative decoding yet: drafts are "
                "proposed from the tokens the last step sampled; drop --async-scheduling"
            )

    def _check_pipeline(self, spec: SpeculativeConfig | None) -> None:
        if self.pipeline_parallel_size == 1:
            return
        if spec is not None:
            raise ValueError(
                "speculative decoding with pipeline_parallel_size > 1 is not supported yet"
            )
        if self.async_scheduling:
            raise ValueError(
                "async scheduling does not work with pipeline parallelism yet: the next step's "
                "inputs are sampled on the last stage; drop --async-scheduling"
            )

    def _check_context_parallel(self, spec: SpeculativeConfig | None) -> None:
        size = self.prefill_context_parallel_size
        if size < 1:
            raise ValueError(f"prefill_context_parallel_size must be >= 1, got {size}")
        if size == 1:
            return
        if self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError(
                "prefill_context_parallel_size > 1 with tensor or pipeline parallelism is not "
                "supported yet"
            )
        if self.cache.block_size % size:
            raise ValueError(
                f"prefill_context_parallel_size={size} must divide the block size "
                f"({self.cache.block_size}): each rank holds block_size / {size} of each block"
            )
        if spec is not None or self.async_scheduling or self.attention_backend == "triton":
            raise ValueError(
                "prefill_context_parallel_size > 1 runs the torch attention backend with "
                "synchronous scheduling and no speculative decoding for now"
            )

    def _check_lora(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(
                f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} and "
                f"{self.max_lora_rank}"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        if self.lora_dtype != "auto" and self.lora_dtype not in _DTYPES:
            raise ValueError(
                f"lora_dtype must be one of auto, {', '.join(_DTYPES)}; got {self.lora_dtype!r}"
            )
        if not self.enable_lora:
            return
        if self.pipeline_parallel_size > 1 or self.prefill_context_parallel_size > 1:
            raise ValueError(
                "--enable-lora with pipeline or prefill context parallelism is not supported "
                "yet; tensor parallelism is"
            )
        if self.is_pooling:
            raise ValueError("--enable-lora serves generating models; --runner pooling has none")

    def _check_pooling(self, spec: SpeculativeConfig | None) -> None:
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {self.runner!r}")
        overrides = parse_hf_overrides(self.hf_overrides)
        object.__setattr__(self, "hf_overrides", overrides)
        architectures = (overrides or {}).get("architectures") or folder_architectures(self.model)
        if self.runner == "auto" and is_classifier(list(architectures)):
            object.__setattr__(self, "runner", "pooling")
        pooler = PoolerConfig.parse(self.pooler_config)
        object.__setattr__(self, "pooler_config", pooler)
        if not self.is_pooling:
            if pooler is not None:
                raise ValueError("pooler_config applies to --runner pooling only")
            return
        if spec is not None or self.pipeline_parallel_size > 1:
            raise ValueError(
                "--runner pooling computes each prompt once and samples nothing: drop "
                "--speculative-config and --pipeline-parallel-size"
            )
        if self.kv_transfer_config is not None or self.prefill_context_parallel_size > 1:
            raise ValueError(
                "--runner pooling with --kv-transfer-config or context parallelism is not supported"
            )

    @property
    def is_pooling(self) -> bool:
        """Whether the engine pools prompts into embeddings (runner "pooling")."""
        return self.runner == "pooling"

    def _check_kv_transfer(self) -> None:
        kv = KVTransferConfig.parse(self.kv_transfer_config)
        object.__setattr__(self, "kv_transfer_config", kv)
        if kv is None:
            return
        if self.world_size > 1:
            raise ValueError(
                "kv_transfer_config with tensor or pipeline parallelism is not supported yet"
            )
        if not self.cache.enable_prefix_caching:
            raise ValueError(
                "kv_transfer_config needs prefix caching: transferred blocks join the prefix "
                "cache; drop --no-enable-prefix-caching"
            )

    @property
    def world_size(self) -> int:
        """Worker processes: tensor_parallel_size ranks in each of pipeline_parallel_size
        stages, or prefill_context_parallel_size ranks; 1: the model runs in the engine's own
        process."""
        parallel = self.tensor_parallel_size * self.pipeline_parallel_size
        return parallel * self.prefill_context_parallel_size

    @property
    def device_type(self) -> str:
        """ "cpu" or "cuda"; "auto" must be resolved first (pagoda/runner/device.py)."""
        if self.device == "auto":
            raise RuntimeError(
                "EngineConfig.device is 'auto': resolve it first (runner.device.resolve_device)"
            )
        return self.device

    def with_device(self, device: str) -> EngineConfig:
        """This config on a concrete device ("cpu" or "cuda"), checked again."""
        return dataclasses.replace(self, device=device)

    @property
    def kernel_backend(self) -> str:
        """The backend in effect: "triton" or "torch" (auto picks triton on CUDA)."""
        if self.attention_backend == "auto":
            cuda = self.device_type == "cuda" and self.prefill_context_parallel_size == 1
            return "triton" if cuda else "torch"
        return self.attention_backend

    @property
    def level(self) -> int:
        """The optimization level in effect (see optimization_level). Tensor- and pipeline-
        parallel ranks run eagerly: their collectives and transfers are not captured in CUDA
        graphs or compiled yet."""
        if self.enforce_eager or self.world_size > 1:
            return 0
        if self.optimization_level is not None:
            return self.optimization_level
        return 2 if self.device_type == "cuda" else 0

    @property
    def use_cuda_graphs(self) -> bool:
        """Decode batches replay captured graphs: CUDA, the triton backend, level >= 1."""
        return self.device_type == "cuda" and self.kernel_backend == "triton" and self.level > 0

    @property
    def compile_decode(self) -> bool:
        """Pure-decode steps run the model through torch.compile: CPU, torch backend, level >= 1."""
        return self.device_type == "cpu" and self.kernel_backend == "torch" and self.level > 0

    @property
    def decode_cpp_wrapper(self) -> bool:
        """Compiled decode steps (compile_decode) run from inductor's C++ wrapper, not its Python
        one: level 3. The wrapper calls a step's ~200 custom ops without Python between them
        (SmolLM2's batch-1 step 3-5 ms shorter on 2 cores) and takes ~2 minutes more to compile
        a graph the first time (inductor's cache keeps it)."""
        return self.compile_decode and self.level >= 3

    @property
    def use_async_scheduling(self) -> bool:
        """Whether async scheduling is in effect (see async_scheduling)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return (
            self.device_type == "cuda"
            and self.speculative_config is None
            and self.pipeline_parallel_size == 1
            and self.prefill_context_parallel_size == 1
        )

    @property
    def dtype_name(self) -> str:
        """The dtype in effect: auto is bfloat16 on CUDA, float32 on CPU."""
        if self.dtype == "auto":
            return "bfloat16" if self.device_type == "cuda" else "float32"
        return self.dtype

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineConfig:
        """Build from flat engine arguments as LLM(...) and the CLI take them (vLLM names)."""
        cache_fields = {f.name for f in dataclasses.fields(CacheConfig)}
        sched_fields = {"max_num_seqs", "max_num_batched_tokens", "max_explained_requests"}
        own_fields = {f.name for f in dataclasses.fields(cls)} - {"cache", "scheduler", "model"}
        cache_kwargs: dict[str, Any] = {}
        sched_kwargs: dict[str, Any] = {}
        own_kwargs: dict[str, Any] = {}
        for key, value in kwargs.items():
            if value is None and key not in own_fields:
                continue
            if key in cache_fields:
                cache_kwargs[key] = value
            elif key in sched_fields:
                sched_kwargs[key] = value
            elif key == "scheduling_policy":
                sched_kwargs["policy"] = value
            elif key in own_fields:
                own_kwargs[key] = value
            else:
                raise ValueError(f"unknown engine argument {key!r}")
        return cls(
            model=model,
            cache=CacheConfig(**cache_kwargs),
            scheduler=SchedulerConfig(**sched_kwargs),
            **own_kwargs,
        )
