"""Engine configuration: frozen dataclasses built once from user arguments (vLLM's flag names).

User errors raise ValueError saying what to change; derived values are properties.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagoda.kv_transfer_config import KVTransferConfig

QUANTIZATION_METHODS = ("none", "int8", "int4", "fp8", "gguf", "awq", "gptq")

_DTYPES = ("float32", "bfloat16", "float16")
SCHEDULING_POLICIES = ("fcfs", "priority")
# auto: triton on CUDA, torch on CPU. torch is the reference every kernel is tested against.
ATTENTION_BACKENDS = ("auto", "torch", "triton")


# --kv-cache-dtype values (vLLM's) -> storage dtype of quantized K/V, each (token, kv head) row
# beside one KV_SCALE_DTYPE scale; "auto" stores the model dtype without scales.
KV_QUANT_DTYPES = {"int8": "int8", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}
KV_CACHE_DTYPES = ("auto", *KV_QUANT_DTYPES)


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
    def kv_quant_dtype(self) -> str | None:
        """Storage dtype of quantized K/V (int8, float8_e4m3fn); None for auto (model dtype)."""
        return KV_QUANT_DTYPES.get(self.kv_cache_dtype)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    policy: str = "fcfs"

    def __post_init__(self) -> None:
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
    # triton) or run decode steps through torch.compile (CPU). None: 2 on CUDA, 0 on CPU, where
    # compiling costs up to a minute of startup. enforce_eager forces 0.
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
    # vLLM's --kv-transfer-config: prefill/decode disaggregation (kv_transfer_config.py); a
    # KVTransferConfig, its dict or its JSON text (parsed here).
    kv_transfer_config: KVTransferConfig | None = None

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
        self._check_kv_transfer()
        if spec is not None and not spec.use_ngram and self.tensor_parallel_size > 1:
            raise ValueError(
                "a draft model with tensor_parallel_size > 1 is not supported yet; use "
                '{"method": "ngram"} or run on one rank'
            )
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
        stages; 1: the model runs in the engine's own process."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

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
            return "triton" if self.device_type == "cuda" else "torch"
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
    def use_async_scheduling(self) -> bool:
        """Whether async scheduling is in effect (see async_scheduling)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return (
            self.device_type == "cuda"
            and self.speculative_config is None
            and self.pipeline_parallel_size == 1
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
        sched_fields = {"max_num_seqs", "max_num_batched_tokens"}
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


# ---- speculative decoding ------------------------------------------------------------------
SPEC_METHODS = ("ngram", "draft_model")
SELF_DRAFT = "self"  # `model` value: the target's own checkpoint, kept quantized as the draft
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default for both prompt_lookup_min and prompt_lookup_max
DEFAULT_MAX_BACKOFF_STEPS = 64
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config: {name} must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates: which proposer, and k, the draft tokens per step.
    `--speculative-config` / `LLM(speculative_config=...)`, vLLM's field names; the scheduler
    may read it. Accepted as a dict or a JSON object string:

        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}
        {"method": "draft_model", "model": "/path/to/draft", "num_speculative_tokens": 4}
        {"model": "self", "quantization": "gguf", "num_speculative_tokens": 4}

    As in vLLM: `method` defaults to "draft_model" when a `model` is given; for "ngram", a
    missing prompt_lookup_min or prompt_lookup_max follows the other, and both default to 5
    when neither is given. Pagoda's own field `max_backoff_steps` (not vLLM's) caps the
    per-request backoff of the proposer: a request whose drafts are all rejected proposes
    nothing for 1, 3, 7, ... steps (never more than max_backoff_steps) until a draft is
    accepted again; 0 turns backoff off.

    A request with k draft tokens is scheduled for k + 1 tokens; verification keeps the accepted
    drafts plus one token of the target's (so 1 to k + 1 tokens per step).
    """

    num_speculative_tokens: int
    method: str = "ngram"
    # ngram: the suffix n-gram lengths tried, longest first; None only before __post_init__
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # draft_model: the draft's HF folder or GGUF file, or "self" (the target's checkpoint)
    model: str | None = None
    # draft_model: the draft's weight scheme (QUANTIZATION_METHODS); None: the
    # draft checkpoint's own
    quantization: str | None = None
    max_backoff_steps: int = DEFAULT_MAX_BACKOFF_STEPS
    # vLLM's (v0) speculative_disable_by_batch_size: no proposals while more requests than this
    # run. Verifying drafts pays where a step is memory-bound (small batches); a large batch's
    # step is compute-bound, so its drafts cost about what they save, and the steps they join
    # lose the compiled decode path (measured W-CPU, benchmarks/README.md). None: never.
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        _positive_int("num_speculative_tokens", self.num_speculative_tokens)
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config: method must be one of {', '.join(SPEC_METHODS)}; "
                f"got {self.method!r}"
            )
        if (
            isinstance(self.max_backoff_steps, bool)
            or not isinstance(self.max_backoff_steps, int)
            or self.max_backoff_steps < 0
        ):
            raise ValueError(
                "speculative_config: max_backoff_steps must be an int >= 0 (0: never back "
                f"off), got {self.max_backoff_steps!r}"
            )
        if self.disable_by_batch_size is not None:
            _positive_int("disable_by_batch_size", self.disable_by_batch_size)
        if self.method == "ngram":
            self._check_ngram()
        else:
            self._check_draft_model()

    def _check_ngram(self) -> None:
        for name in ("model", "quantization"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"speculative_config: {name} is for method 'draft_model', not 'ngram'"
                )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is not None:
            low = _positive_int("prompt_lookup_min", low)
        if high is not None:
            high = _positive_int("prompt_lookup_max", high)
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        assert low is not None and high is not None
        if low > high:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({low}) must be <= "
                f"prompt_lookup_max ({high})"
            )
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    def _check_draft_model(self) -> None:
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"speculative_config: {name} is for method 'ngram', not 'draft_model'"
                )
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(
                "speculative_config: method 'draft_model' needs a model (a draft checkpoint's "
                f"path, or {SELF_DRAFT!r} with a quantization); got {self.model!r}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                "speculative_config: quantization must be one of "
                f"{', '.join(QUANTIZATION_METHODS)}; got {self.quantization!r}"
            )
        if self.is_self_draft and self.quantization in (None, "none"):
            raise ValueError(
                f"speculative_config: model {SELF_DRAFT!r} drafts with the target's own "
                "checkpoint, so it needs a quantization for the draft (e.g. gguf or int4)"
            )

    @property
    def num_lookahead_slots(self) -> int:
        """The most tokens one request asks for in a step beyond its first: k."""
        return self.num_speculative_tokens

    @property
    def use_ngram(self) -> bool:
        return self.method == "ngram"

    @property
    def is_self_draft(self) -> bool:
        """A draft_model whose weights are the target's checkpoint, quantized."""
        return self.method == "draft_model" and self.model == SELF_DRAFT

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SpeculativeConfig:
        """Build from vLLM's field names; unknown fields and bad values raise ValueError."""
        if not isinstance(values, Mapping):
            raise ValueError(
                f"speculative_config must be a JSON object or a dict, got {type(values).__name__}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in values if k not in known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown field(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        if "num_speculative_tokens" not in values:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        kwargs = dict(values)
        if kwargs.get("method") is None:
            if kwargs.get("model") is None:
                raise ValueError(
                    "speculative_config: set method to 'ngram', or give a draft model "
                    "(method 'draft_model')"
                )
            kwargs["method"] = "draft_model"
        return cls(**kwargs)

    @classmethod
    def parse(
        cls, value: str | Mapping[str, Any] | SpeculativeConfig | None
    ) -> SpeculativeConfig | None:
        """The config from a JSON object string (the CLI flag), a dict (the Python API), a config
        (returned as is), or None (no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, str):
            return cls.from_dict(value)
        try:
            values = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        return cls.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set, by vLLM's names (for logs and benchmark JSON)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
