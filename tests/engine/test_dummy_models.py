"""Config-only model folders: benchmarks/models/ (real configs, no weights, no tokenizer) and a
tiny Llama folder run with random weights (`load_format="dummy"`) and `skip_tokenizer_init`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from pagoda import LLM, SamplingParams
from pagoda.cli import main
from pagoda.layers.rotary import compute_inv_freq, rope_parameters
from pagoda.loading.tokenizer import has_tokenizer, load_tokenizer
from pagoda.models import get_model_class
from pagoda.models.llama import LlamaForCausalLM
from pagoda.models.qwen3 import Qwen3ForCausalLM

MODELS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "models"

# folder -> (pagoda class, parameters in millions as published, rounded)
BENCH_MODELS = {
    "SmolLM2-135M-Instruct": (LlamaForCausalLM, 134.5),
    "Qwen3-0.6B": (Qwen3ForCausalLM, 596.0),
    "Llama-3.2-1B": (LlamaForCausalLM, 1236.0),
}


def expected_num_params(cfg: Any) -> int:
    """Parameters of a Llama / Qwen3 decoder from its config: embedding (and an untied LM head),
    per layer q/k/v/o, gate/up/down and two norms (plus Qwen3's per-head q/k norms), final norm."""
    hidden, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden
    qk_norms = 2 * head_dim if cfg.model_type == "qwen3" else 0
    layer = attention + 3 * hidden * inter + 2 * hidden + qk_norms
    embeddings = vocab * hidden * (1 if cfg.tie_word_embeddings else 2)
    return embeddings + cfg.num_hidden_layers * layer + hidden


@pytest.mark.parametrize("name", list(BENCH_MODELS))
def test_bench_model_config_builds_with_known_size(name: str) -> None:
    folder = MODELS_DIR / name
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"]
    assert not has_tokenizer(str(folder))
    cfg = AutoConfig.from_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"
    cls, published_millions = BENCH_MODELS[name]
    assert get_model_class(cfg.architectures) is cls
    with torch.device("meta"):
        model = cls(cfg, torch.bfloat16)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{name}: {num_params:,} parameters")
    assert num_params == expected_num_params(cfg)
    assert round(num_params / 1e6, 1 if published_millions < 200 else 0) == published_millions
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_llama_3_2_rope_is_llama3_scaled() -> None:
    params = rope_parameters(AutoConfig.from_pretrained(MODELS_DIR / "Llama-3.2-1B"))
    assert params["rope_type"] == "llama3" and params["rope_theta"] == 500000.0
    assert (params["factor"], params["low_freq_factor"], params["high_freq_factor"]) == (32, 1, 4)
    assert params["original_max_position_embeddings"] == 8192
    scaled = compute_inv_freq(params, 64)
    plain = compute_inv_freq({"rope_type": "default", "rope_theta": 500000.0}, 64)
    # The highest frequency is kept, the lowest is divided by the factor.
    assert scaled[0] == plain[0]
    assert torch.allclose(scaled[-1], plain[-1] / 32)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Llama-3.2-1B's config shrunk to 2 layers of width 64 (llama3 rope kept), untied;
    config.json only."""
    config = json.loads((MODELS_DIR / "Llama-3.2-1B" / "config.json").read_text())
    config.update(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=10240,  # above the benches' random ids in [0, 10000]
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        # Tied random embeddings make greedy decoding repeat the last token whatever the seed.
        tie_word_embeddings=False,
    )
    config["rope_scaling"]["original_max_position_embeddings"] = 64
    folder = tmp_path_factory.mktemp("tiny-config-only")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return str(folder)


ENGINE_ARGS: dict[str, Any] = dict(
    load_format="dummy", skip_tokenizer_init=True, num_gpu_blocks_override=64, device="cpu"
)
PROMPTS = [{"prompt_token_ids": [5, 17, 400, 9000]}, {"prompt_token_ids": list(range(30, 50))}]


@pytest.fixture(scope="module")
def tiny_llm(tiny_folder: str) -> LLM:
    return LLM(tiny_folder, **ENGINE_ARGS)


def test_token_ids_in_token_ids_out(tiny_llm: LLM) -> None:
    assert tiny_llm.get_tokenizer() is None
    assert tiny_llm.engine.eos_token_ids == {2}  # from config.json
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    outs = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt is None and out.prompt_token_ids == prompt["prompt_token_ids"]
        sample = out.outputs[0]
        assert sample.text == ""
        assert len(sample.token_ids) == 8 and sample.finish_reason == "length"
        assert all(0 <= t < 10240 for t in sample.token_ids)
        assert sample.logprobs is not None
        assert all(lp[t].decoded_token is None for lp, t in zip(sample.logprobs, sample.token_ids))
    streamed = [o.outputs[0] for o in tiny_llm.generate_stream(PROMPTS[0], params)]
    assert [t for d in streamed for t in d.token_ids] == outs[0].outputs[0].token_ids
    assert all(d.text == "" for d in streamed)


def test_same_seed_same_tokens(tiny_folder: str, tiny_llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, params, use_tqdm=False)]
    again = LLM(tiny_folder, **ENGINE_ARGS)  # fresh random weights from the same seed
    second = [o.outputs[0].token_ids for o in again.generate(PROMPTS, params, use_tqdm=False)]
    assert first == second
    other = LLM(tiny_folder, **ENGINE_ARGS, seed=1)
    third = [o.outputs[0].token_ids for o in other.generate(PROMPTS, params, use_tqdm=False)]
    assert third != first


def test_folder_without_tokenizer_needs_the_flag(tiny_folder: str) -> None:
    with pytest.raises(ValueError, match="--skip-tokenizer-init"):
        LLM(tiny_folder, load_format="dummy", num_gpu_blocks_override=64, device="cpu")
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_tokenizer(tiny_folder, None)


@pytest.mark.parametrize(
    "call",
    [
        lambda llm: llm.generate("Hello", use_tqdm=False),
        lambda llm: llm.generate({"prompt": "Hello"}, use_tqdm=False),
        lambda llm: llm.generate(PROMPTS[0], SamplingParams(stop=["."]), use_tqdm=False),
        lambda llm: list(llm.generate_stream(PROMPTS[0], SamplingParams(stop=["x"]))),
        lambda llm: llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False),
    ],
    ids=["text", "text-dict", "stop", "stream-stop", "chat"],
)
def test_text_needs_a_tokenizer(tiny_llm: LLM, call: Any) -> None:
    with pytest.raises(ValueError, match="needs a tokenizer"):
        call(tiny_llm)
    assert not tiny_llm.engine.has_unfinished_requests()


def test_bench_throughput_and_latency_on_config_only_folder(
    tiny_folder: str, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = ["--model", tiny_folder, "--load-format", "dummy", "--num-gpu-blocks-override", "64"]
    workload = ["--num-prompts", "4", "--input-len-range", "8,16", "--output-len-range", "4,8"]
    assert main(["bench", "throughput", *engine, *workload]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["engine_args"]["skip_tokenizer_init"] is True
    assert record["pagoda"]["num_output_tokens"] == record["workload"]["num_output_tokens"]
    assert record["pagoda"]["output_tok_s"] > 0
    latency = ["--input-len", "16", "--output-len", "4", "--num-iters", "1"]
    assert main(["bench", "latency", *engine, *latency]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["engine_args"]["skip_tokenizer_init"] is True
    assert record["pagoda"]["num_output_tokens"] == [4]
    assert record["pagoda"]["e2e_tok_s"] > 0 and record["pagoda"]["decode_tok_s"] > 0


def test_serve_refuses_skip_tokenizer_init(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--skip-tokenizer-init"]) == 2
    assert "--skip-tokenizer-init" in capsys.readouterr().err
