"""The transformers tokenizer of a model: an HF folder's tokenizer files, or the tokenizer of a
GGUF file converted once and cached (see pagoda/loading/model_files.py), with its chat
template.

A GGUF file's cache entry also records (pagoda_tokenizer.json) the class AutoTokenizer picks for
the entry and the tokenizer's EOS id. Later starts load that class directly: AutoTokenizer's
class lookup imports transformers' config classes and torch (seconds), the tokenizer classes do
not. The engine process, whose client holds the tokenizer, reads only the EOS id from the record.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from typing import Any

from pagoda.config import EngineConfig
from pagoda.loading.gguf_index import (
    gguf_string_field,
    gguf_user_defined_tokens,
    read_gguf_index,
)
from pagoda.loading.model_files import gguf_cache_dir, resolve_model, save_to_cache

logger = logging.getLogger(__name__)

# Any of these in an HF folder means it ships a tokenizer (transformers' file names: fast
# tokenizer, tokenizer config, sentencepiece, BPE vocab, WordPiece vocab, tiktoken, Mistral tekken).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "tiktoken.model",
    "tekken.json",
)
RECORD_FILE = "pagoda_tokenizer.json"  # {"class": "module:QualName", "eos_token_id": int | None}


def has_tokenizer(model: str | None) -> bool:
    """Whether the model (or tokenizer) path has tokenizer files: a GGUF file always does."""
    folder, gguf_file = resolve_model(model)
    return gguf_file is not None or _has_tokenizer_files(folder)


def _has_tokenizer_files(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES)


def load_tokenizer(folder: str, gguf_file: str | None, trust_remote_code: bool = False) -> Any:
    """The transformers tokenizer (with its chat template) of an HF folder or a GGUF file."""
    # Imported where needed: `from transformers import AutoTokenizer` imports torch.
    if gguf_file is None:
        if not _has_tokenizer_files(folder):
            raise ValueError(
                f"{folder} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); pass "
                "--tokenizer PATH, or --skip-tokenizer-init (LLM(..., skip_tokenizer_init=True)) "
                "to run without a tokenizer on token-id prompts"
            )
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    gguf_path = os.path.join(folder, gguf_file)
    cached = gguf_cache_dir("tokenizers", gguf_path)
    tokenizer = _from_cache(cached)
    if tokenizer is not None:
        return tokenizer
    logger.info("converting the tokenizer of %s (once; cached in %s)", gguf_path, cached)
    tokenizer = _convert(folder, gguf_file)
    _match_user_defined_whole(tokenizer, gguf_path)
    if tokenizer.chat_template is None:
        template = gguf_string_field(gguf_path, "tokenizer.chat_template")
        if template is not None:
            tokenizer.chat_template = template
    save_to_cache(lambda tmp: _save_entry(tokenizer, tmp), cached)
    saved = _from_cache(cached)  # as every later start loads it
    return tokenizer if saved is None else saved


def _convert(folder: str, gguf_file: str) -> Any:
    """transformers' tokenizer of a GGUF file. AutoTokenizer picks its class by the config it
    converts from the file, and refuses an architecture it does not read (a family whose config
    pagoda builds, ModelFamily.gguf_model_type): there the vocabulary alone makes a fast
    tokenizer (the conversion goes by tokenizer.ggml.model, whatever the architecture)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from pagoda.models import gguf_family

    fields = read_gguf_index(os.path.join(folder, gguf_file)).fields
    family = gguf_family(str(fields.get("general.architecture")), fields)
    if family is not None and family.gguf_model_type is not None:
        return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=gguf_file)
    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)


def _match_user_defined_whole(tokenizer: Any, gguf_path: str) -> None:
    """SentencePiece and llama.cpp match a file's user-defined tokens whole in the text, before
    the model's own segmentation; transformers' conversion registers only some of them as added
    tokens (Gemma 3's runs of 2-31 spaces, ids 138-167, are not, so its model splits a run of 53
    spaces 16 + 16 + 21 where llama.cpp takes 31 + 22). The rest are registered here under their
    own ids, as the normalizer writes them (Gemma: spaces as U+2581); a token whose text is not
    in the vocabulary is left alone rather than given a new id."""
    from tokenizers import AddedToken

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return
    normalizer = backend.normalizer
    added, vocab = tokenizer.get_added_vocab(), tokenizer.get_vocab()
    missing = []
    for text in gguf_user_defined_tokens(gguf_path):
        content = text if normalizer is None else normalizer.normalize_str(text)
        if text not in added and content not in added and content in vocab:
            missing.append(AddedToken(content, normalized=normalizer is not None, special=False))
    if missing:
        tokenizer.add_tokens(missing)


def _save_entry(tokenizer: Any, folder: str) -> None:
    """The tokenizer's files and its record: the class AutoTokenizer picks for them, EOS id."""
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(folder)
    reloaded = AutoTokenizer.from_pretrained(folder)
    cls = type(reloaded)
    record = {
        "class": f"{cls.__module__}:{cls.__qualname__}",
        "eos_token_id": _int_or_none(reloaded.eos_token_id),
    }
    with open(os.path.join(folder, RECORD_FILE), "w") as f:
        json.dump(record, f)


def _record(cached: str) -> dict[str, Any] | None:
    """The record of a cache entry; None if there is none or it cannot be read."""
    try:
        with open(os.path.join(cached, RECORD_FILE)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and str(record.get("class", "")).startswith("transformers.")
    return record if ok else None


def _from_cache(cached: str | None) -> Any:
    """The tokenizer of a cache entry through the class its record names (AutoTokenizer's
    choice for the entry when it was written); None without an entry."""
    record = None if cached is None else _record(cached)
    if cached is None or record is None:
        return None
    module, _, name = record["class"].partition(":")
    cls: Any = importlib.import_module(module)
    for part in name.split("."):
        cls = getattr(cls, part)
    return cls.from_pretrained(cached)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) else None


def load_tokenizer_for(config: EngineConfig) -> Any:
    """The tokenizer of `config.tokenizer`, or of the model itself."""
    folder, gguf_file = resolve_model(config.tokenizer or config.model)
    return load_tokenizer(folder, gguf_file, config.trust_remote_code)


def tokenizer_eos_token_id(config: EngineConfig) -> int | None:
    """The EOS id of load_tokenizer_for(config): for a GGUF file read from its cache entry's
    record (transformers is not imported), else from the loaded tokenizer."""
    folder, gguf_file = resolve_model(config.tokenizer or config.model)
    if gguf_file is not None:
        cached = gguf_cache_dir("tokenizers", os.path.join(folder, gguf_file))
        record = None if cached is None else _record(cached)
        if record is not None:
            return _int_or_none(record.get("eos_token_id"))
    return _int_or_none(load_tokenizer(folder, gguf_file, config.trust_remote_code).eos_token_id)
