"""The transformers tokenizer of a model: an HF folder's tokenizer files, or the tokenizer of a
GGUF file converted once and cached (see pagoda/loading/model_files.py), with its chat
template."""

from __future__ import annotations

import logging
import os
from typing import Any

from transformers import AutoTokenizer

from pagoda.config import EngineConfig
from pagoda.loading.gguf import gguf_string_field
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


def has_tokenizer(model: str | None) -> bool:
    """Whether the model (or tokenizer) path has tokenizer files: a GGUF file always does."""
    folder, gguf_file = resolve_model(model)
    return gguf_file is not None or _has_tokenizer_files(folder)


def _has_tokenizer_files(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES)


def load_tokenizer(folder: str, gguf_file: str | None, trust_remote_code: bool = False) -> Any:
    """The transformers tokenizer (with its chat template) of an HF folder or a GGUF file."""
    if gguf_file is None:
        if not _has_tokenizer_files(folder):
            raise ValueError(
                f"{folder} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); pass "
                "--tokenizer PATH, or --skip-tokenizer-init (LLM(..., skip_tokenizer_init=True)) "
                "to run without a tokenizer on token-id prompts"
            )
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    gguf_path = os.path.join(folder, gguf_file)
    cached = gguf_cache_dir("tokenizers", gguf_path)
    if os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(cached)
    logger.info("converting the tokenizer of %s (once; cached in %s)", gguf_path, cached)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    if tokenizer.chat_template is None:
        template = gguf_string_field(gguf_path, "tokenizer.chat_template")
        if template is not None:
            tokenizer.chat_template = template
    save_to_cache(tokenizer.save_pretrained, cached)
    return tokenizer


def load_tokenizer_for(config: EngineConfig) -> Any:
    """The tokenizer of `config.tokenizer`, or of the model itself."""
    folder, gguf_file = resolve_model(config.tokenizer or config.model)
    return load_tokenizer(folder, gguf_file, config.trust_remote_code)
