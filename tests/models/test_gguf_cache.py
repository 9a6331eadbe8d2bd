"""The GGUF caches (pagoda/loading/model_files.py): where they live (PAGODA_CACHE_DIR,
XDG_CACHE_HOME, HOME; nowhere without them), their keys, a cache that cannot be written, and what
an entry gives back: the config with every field of transformers' and the tokenizer AutoTokenizer
loads, both read without importing transformers' config classes (or, for the engine's EOS id,
transformers at all)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig, AutoTokenizer

from pagoda.config import EngineConfig
from pagoda.loading.hf_config import GGUFConfig, load_hf_config
from pagoda.loading.model_files import cache_root, gguf_cache_dir, save_to_cache
from pagoda.loading.tokenizer import RECORD_FILE, load_tokenizer, tokenizer_eos_token_id

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in één word."}]


def test_cache_root_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PAGODA_CACHE_DIR", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)
    home = os.path.expanduser("~")  # the password entry's, HOME being unset
    assert cache_root() == (os.path.join(home, ".cache", "pagoda") if home != "~" else None)
    monkeypatch.setenv("HOME", "")
    assert cache_root() is None  # nothing is cached
    monkeypatch.setenv("HOME", "/h")
    assert cache_root() == "/h/.cache/pagoda"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # ignored, as the XDG spec says
    assert cache_root() == "/h/.cache/pagoda"
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert cache_root() == "/xdg/pagoda"
    monkeypatch.setenv("PAGODA_CACHE_DIR", "/p")
    assert cache_root() == "/p"


def test_keys_follow_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path in (a, b):
        path.parent.mkdir()
        path.write_bytes(b"GGUF" + bytes(60))
    entry = gguf_cache_dir("configs", str(a))
    assert entry is not None and entry.startswith(str(tmp_path / "cache" / "configs" / "m-"))
    assert gguf_cache_dir("configs", str(a)) == entry
    assert gguf_cache_dir("tokenizers", str(a)) != entry
    assert gguf_cache_dir("configs", str(b)) != entry  # another file, the same bytes
    os.utime(a, ns=(0, 10**9))
    assert gguf_cache_dir("configs", str(a)) != entry  # the file changed
    a.write_bytes(b"GGUF" + bytes(61))
    os.utime(a, ns=(0, 10**9))
    assert gguf_cache_dir("configs", str(a)) != entry


def test_unwritable_cache_is_skipped(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    calls: list[str] = []
    assert not save_to_cache(calls.append, str(blocker / "configs" / "entry"))
    assert not save_to_cache(calls.append, None)
    assert calls == []

    def failing(folder: str) -> None:
        raise OSError("disk full")

    target = tmp_path / "configs" / "entry"
    assert not save_to_cache(failing, str(target))
    assert not target.exists() and os.listdir(target.parent) == []  # no half entry left


@pytest.fixture(scope="module")
def cache(smollm2_path: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A cache of its own, filled by the first loads (the conversions)."""
    root = tmp_path_factory.mktemp("pagoda-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGODA_CACHE_DIR", str(root))
        folder, name = os.path.split(smollm2_path)
        converted = (load_hf_config(folder, name), load_tokenizer(folder, name))
    return root, converted


def test_config_entry_has_every_field(
    cache: Any, smollm2_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, (converted, _) = cache
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(root))
    folder, name = os.path.split(smollm2_path)
    fresh = json.loads(
        AutoConfig.from_pretrained(folder, gguf_file=name).to_json_string(use_diff=False)
    )
    cached = load_hf_config(folder, name)
    assert isinstance(cached, GGUFConfig) and isinstance(converted, GGUFConfig)
    assert cached.to_dict() == converted.to_dict() == fresh
    assert cached.model_type == "llama" and cached.rope_parameters["rope_theta"] == 100000.0


def test_tokenizer_entry_loads_as_autotokenizer_does(
    cache: Any, smollm2_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, (_, converted) = cache
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(root))
    folder, name = os.path.split(smollm2_path)
    entry = gguf_cache_dir("tokenizers", smollm2_path)
    assert entry is not None
    record = json.loads(Path(entry, RECORD_FILE).read_text())
    auto = AutoTokenizer.from_pretrained(entry)
    cached = load_tokenizer(folder, name)
    for tok in (converted, cached):
        assert type(tok) is type(auto)
        assert record["class"] == f"{type(auto).__module__}:{type(auto).__qualname__}"
        assert tok.get_vocab() == auto.get_vocab()
        assert tok.special_tokens_map == auto.special_tokens_map
        assert tok.chat_template == auto.chat_template is not None
        assert tok.init_kwargs == auto.init_kwargs
        text = auto.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == text
        assert tok.encode(text) == auto.encode(text)
        assert tok.decode(auto.encode(text)) == auto.decode(auto.encode(text))
    assert record["eos_token_id"] == auto.eos_token_id == 2
    assert tokenizer_eos_token_id(EngineConfig(model=smollm2_path)) == 2


def test_engine_side_reads_the_entries_without_transformers(cache: Any, smollm2_path: str) -> None:
    """The engine process's config and EOS id import no transformers; the client's tokenizer
    imports no torch (AutoTokenizer's class lookup would)."""
    root, _ = cache
    code = (
        "import os, sys\n"
        "from pagoda.config import EngineConfig\n"
        "from pagoda.loading.hf_config import load_hf_config\n"
        "from pagoda.loading.tokenizer import load_tokenizer_for, tokenizer_eos_token_id\n"
        f"path = {smollm2_path!r}\n"
        "config = load_hf_config(*os.path.split(path))\n"
        "eos = tokenizer_eos_token_id(EngineConfig(model=path))\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'\n"
        "tokenizer = load_tokenizer_for(EngineConfig(model=path))\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print(config.num_hidden_layers, eos, tokenizer.eos_token_id)\n"
    )
    env = {**os.environ, "PAGODA_CACHE_DIR": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["30", "2", "2"]


def test_without_a_cache_dir_every_load_converts(
    smollm2_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("PAGODA_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", "")
    folder, name = os.path.split(smollm2_path)
    assert gguf_cache_dir("configs", smollm2_path) is None
    assert load_hf_config(folder, name).num_hidden_layers == 30
    # The EOS id converts the tokenizer (load_tokenizer's conversion is the `cache` fixture's).
    assert tokenizer_eos_token_id(EngineConfig(model=smollm2_path)) == 2


def test_engine_without_its_tokenizer_keeps_the_eos_ids(
    cache: Any, smollm2_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine process's EngineCore (load_tokenizer=False) reads the tokenizer's EOS id from
    the cache entry: the same EOS ids as an engine that loads the tokenizer."""
    from pagoda.engine.core import EngineCore

    root, _ = cache
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(root))
    config = EngineConfig.from_kwargs(smollm2_path, num_gpu_blocks_override=8)
    with_tokenizer = EngineCore(config)
    without = EngineCore(config, load_tokenizer=False)
    assert with_tokenizer.tokenizer is not None and without.tokenizer is None
    assert without.eos_token_ids == with_tokenizer.eos_token_ids == frozenset({2})
