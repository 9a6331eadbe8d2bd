"""The documentation: README.md and the MkDocs site under docs/ (mkdocs.yml).

- The site builds with `mkdocs build --strict` (every bad link or anchor a failure), every page
  under docs/ is in the nav and every nav entry is a page; README.md stays under 200 lines.
- Every ```python block of README.md and docs/*.md runs, each alone in a fresh interpreter
  (there is no shared setup: a block is a whole program), on the embedded default model. Blocks
  that talk to a server (their text names `127.0.0.1:8000`) run against one `pagoda serve`
  this module starts as the README's serving example does, on a free port written in place of
  8000; those naming `127.0.0.1:8002`, against a second one with `--runner pooling` (the
  embeddings examples), and `127.0.0.1:8003` a third one under the Qwen3-Reranker recipe
  (`--hf-overrides`: rerank and score). A block whose first line is a comment naming a Python file of the repository
  (`# pagoda/models/mistral.py`) is that file's code, and must stay so: it also runs, and its
  syntax tree must equal the file's (without the module docstring and `__future__` imports).
- Every command line of the ```bash / ```console blocks is checked by what it calls:
  - `pagoda ...` (or `.venv/bin/pagoda ...`) is parsed by pagoda's own parser
    (`pagoda.cli.build_parser`), and every flag must be one of its subcommand's own option
    strings (argparse would accept an abbreviation of a renamed flag); `--speculative-config`
    and `--kv-transfer-config` values must parse as those configs. Of these, the
    `pagoda generate` lines with `--max-tokens` at most 64 also run, on the embedded model.
    Every other `pagoda` line is parsed only: `serve` lines start servers that run until
    stopped (the module's one server stands for the plain `pagoda serve`; the disaggregation
    example needs three), `bench`, `plan` and `chat` take minutes or a terminal, and some need
    a GPU (`--device cuda`), a Ray cluster (`--ray`) or several ranks.
  - `curl` lines run against the module's server (their URL, `-H` headers and `-d` body, sent
    with httpx), and must answer 200.
  - `make T`: T is a target of the Makefile. `python FILE` / `bash FILE`: FILE exists;
    `python -m MODULE`: MODULE can be imported. `serve run|deploy FILE` (Ray's CLI): FILE
    exists. Every word that names a path of the repository (`benchmarks/...`, `tests/...`, ...)
    exists.
  - Any other command fails the test, so a new kind of example must say here how it is checked.
- Every `--flag` written anywhere in the pages is one of pagoda's (any subcommand's), or one of
  FOREIGN_FLAGS, the other programs' flags the pages mention.
- The line counts README.md and docs/architecture.md give for the core and the server are
  within 10% of the tree's.

The whole module takes about 40 s on the 2-core development machine (the examples run three at
a time beside the server).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from pagoda.cli import build_parser
from pagoda.kv_transfer_config import KVTransferConfig
from pagoda.speculative_config import SpeculativeConfig

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
DOC_SERVER = "127.0.0.1:8000"  # the address the examples use for `pagoda serve`
# ... and for `pagoda serve --runner pooling --port 8002` (the embeddings examples)
POOLING_SERVER = "127.0.0.1:8002"
# ... and for the embedded model under the Qwen3-Reranker recipe on 8003 (rerank and score)
RERANK_SERVER = "127.0.0.1:8003"
RERANKER = (
    '{"architectures": ["LlamaForSequenceClassification"], '
    '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'
)
RUN_TIMEOUT_S = 180.0
# Three examples and a server share the cores: a thread each wastes less than torch's pools
# contending (about a fifth less time for the module on two cores).
EXAMPLE_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
MAX_RUN_TOKENS = 64  # `pagoda generate` lines up to this --max-tokens run
REPO_DIRS = ("benchmarks/", "deploy/", "docs/", "pagoda/", "requirements/", "tests/")
# Flags of other programs that the pages mention, and whose they are.
FOREIGN_FLAGS = {
    "--address": "ray start",
    "--head": "ray start",
    "--dist": "pytest-xdist",
    "--no-deps": "pip install",
    "--no-install-recommends": "apt-get install",
    "--strict": "mkdocs build",
}


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repo root
    line: int  # of the opening fence
    lang: str
    code: str


def fenced_blocks(path: Path) -> list[Block]:
    blocks: list[Block] = []
    lang: str | None = None
    body: list[str] = []
    start = 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = re.fullmatch(r"```\s*([\w+-]*)\s*", line)
        if lang is None and fence:
            lang, body, start = fence.group(1), [], number
        elif lang is not None and line.strip() == "```":
            page = str(path.relative_to(ROOT))
            blocks.append(Block(page, start, lang, "\n".join(body) + "\n"))
            lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"{path}: a code block opened at line {start} is not closed"
    return blocks


BLOCKS = [b for page in PAGES for b in fenced_blocks(page)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]


@dataclass(frozen=True)
class Command:
    block: Block
    index: int  # its place among the block's command lines
    text: str  # one command line, continuations joined
    argv: tuple[str, ...]  # without leading VAR=value assignments and comments

    @property
    def where(self) -> str:
        return f"{self.block.page}:{self.block.line}: {self.text}"


def commands() -> list[Command]:
    out: list[Command] = []
    for block in BLOCKS:
        if block.lang not in ("bash", "console", "sh", "shell"):
            continue
        logical = block.code.replace("\\\n", " ")
        index = 0
        for line in logical.splitlines():
            line = line.strip().removeprefix("$ ")
            argv = shlex.split(line, comments=True)
            while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):
                argv = argv[1:]
            if argv:
                out.append(Command(block, index, line, tuple(argv)))
                index += 1
    return out


COMMANDS = commands()


def program(argv: tuple[str, ...]) -> str:
    return Path(argv[0]).name if argv[0].endswith("/pagoda") else argv[0]


# --- the site --------------------------------------------------------------------------------


def test_the_site_builds_strict(tmp_path: Path) -> None:
    """`mkdocs build --strict`: a broken link, a missing anchor or a link out of docs/ fails."""
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "s")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0 and "WARNING" not in log, log
    assert (tmp_path / "s" / "index.html").is_file()


def _nav_pages(entry: object) -> Iterator[str]:
    if isinstance(entry, str):
        yield entry
    elif isinstance(entry, list):
        for item in entry:
            yield from _nav_pages(item)
    elif isinstance(entry, dict):
        for value in entry.values():
            yield from _nav_pages(value)


def test_the_nav_lists_every_page_and_only_pages() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs" and config["site_name"] == "pagoda"
    nav = list(_nav_pages(config["nav"]))
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert len(nav) == len(set(nav)), f"pages listed twice in the nav: {nav}"
    assert sorted(nav) == pages, (
        f"not in the nav: {sorted(set(pages) - set(nav))}; "
        f"in the nav but not under docs/: {sorted(set(nav) - set(pages))}"
    )


def test_the_readme_is_short_and_links_every_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    linked = set(re.findall(r"\]\(docs/([\w./-]+\.md)(?:#[\w-]+)?\)", readme))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")} - {"index.md"}
    assert not pages - linked, f"README.md does not link {sorted(pages - linked)}"
    for page in linked:
        assert (DOCS / page).is_file(), f"README.md links docs/{page}, which does not exist"


# --- flags and command lines -----------------------------------------------------------------


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _all_options(parser: argparse.ArgumentParser) -> set[str]:
    out = _options(parser)
    for sub in _subparsers(parser).values():
        out |= _all_options(sub)
    return out


PARSER = build_parser()


def test_every_flag_the_pages_name_exists() -> None:
    known = _all_options(PARSER)
    unknown: dict[str, list[str]] = {}
    for page in PAGES:
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", page.read_text()):
            if flag not in known and flag not in FOREIGN_FLAGS:
                unknown.setdefault(flag, []).append(str(page.relative_to(ROOT)))
    assert not unknown, f"flags that no pagoda command takes: {unknown}"


def parse_pagoda(command: Command) -> argparse.Namespace:
    """Parse a `pagoda ...` line as `pagoda` would, and check each flag exactly."""
    argv = list(command.argv[1:])
    parser = PARSER
    for word in argv:  # the subcommand path: `bench latency`, `serve`, ...
        choices = _subparsers(parser)
        if word not in choices:
            break
        parser = choices[word]
    options = _options(parser)
    short = {o for o in options if re.fullmatch(r"-[A-Za-z]", o)}
    for word in argv:
        if not word.startswith("-"):
            continue
        name = word.split("=", 1)[0]
        attached = any(word.startswith(s) and len(word) > 2 for s in short)  # -O2
        assert name in options or attached, f"{command.where}: no flag {name}"
    try:
        args = PARSER.parse_args(argv)
    except SystemExit as e:
        raise AssertionError(f"{command.where}: pagoda's parser refused it") from e
    if getattr(args, "speculative_config", None):
        SpeculativeConfig.parse(args.speculative_config)
    if getattr(args, "kv_transfer_config", None):
        KVTransferConfig.parse(args.kv_transfer_config)
    return args


def runs(command: Command) -> bool:
    """The command lines that run, not only parse: cheap `pagoda generate` lines and curl."""
    if program(command.argv) == "curl":
        return True
    if program(command.argv) == "pagoda" and command.argv[1:2] == ("generate",):
        try:
            args = parse_pagoda(command)
        except AssertionError:
            return False  # test_every_command_line_is_checked reports it
        return bool(args.max_tokens <= MAX_RUN_TOKENS)
    return False


def _makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([\w.-]+):", text, flags=re.M))


def test_every_command_line_is_checked() -> None:
    """Each line of a shell block, by what it calls (the module docstring lists the rules)."""
    targets = _makefile_targets()
    problems: list[str] = []
    for command in COMMANDS:
        argv = command.argv
        name = program(argv)
        for word in shlex.split(command.text, comments=True):
            path = word.split("=", 1)[-1]
            if path.startswith(REPO_DIRS) and not (ROOT / path).exists():
                problems.append(f"{command.where}: {path} does not exist")
        if name == "pagoda":
            try:
                parse_pagoda(command)
            except (AssertionError, ValueError) as e:
                problems.append(str(e))
        elif name == "curl":
            if not any(uses_server(w) for w in argv):
                problems.append(f"{command.where}: not the address of the module's server")
        elif name == "make":
            missing = [t for t in argv[1:] if t not in targets]
            if missing:
                problems.append(f"{command.where}: no Makefile target {missing}")
        elif name in ("python", "bash") or name.endswith("/python"):
            if argv[1] == "-m":
                if argv[2] != "pytest" and importlib.util.find_spec(argv[2]) is None:
                    problems.append(f"{command.where}: no module {argv[2]}")
            elif not (ROOT / argv[1]).is_file():
                problems.append(f"{command.where}: no file {argv[1]}")
        elif name == "serve" and argv[1] in ("run", "deploy"):
            if not (ROOT / argv[2]).is_file():
                problems.append(f"{command.where}: no file {argv[2]}")
        else:
            problems.append(f"{command.where}: no rule checks `{name}` (test_docs.py docstring)")
    assert not problems, "\n".join(problems)


# --- the examples that run -------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DocServer:
    """The README's `pagoda serve` (the embedded model), with `flags`, on a free port."""

    def __init__(self, flags: tuple[str, ...] = ()) -> None:
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - lives as the server
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagoda.cli", "serve", "--port", str(self.port), *flags],
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=EXAMPLE_ENV,
        )
        self._ready = False

    def wait_ready(self) -> None:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not self._ready:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"pagoda serve exited:\n{self.log.read()}")
            try:
                self._ready = httpx.get(f"http://{self.address}/health").status_code == 200
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("pagoda serve did not become ready")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def uses_server(text: str) -> bool:
    return any(address in text for address in (DOC_SERVER, POOLING_SERVER, RERANK_SERVER))


def _on_servers(text: str, servers: dict[str, DocServer]) -> str:
    """`text` with each documented address it names replaced by its server's, once it is up."""
    for documented, server in servers.items():
        if documented in text:
            server.wait_ready()
            text = text.replace(documented, server.address)
    return text


def run_python(block: Block, servers: dict[str, DocServer]) -> str:
    code = _on_servers(block.code, servers)
    return _run([sys.executable, "-c", code], f"{block.page}:{block.line}")


def _run(argv: list[str], where: str) -> str:
    """argv's stdout; fails naming `where` unless it exits 0."""
    out = subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=EXAMPLE_ENV
    )
    assert out.returncode == 0, f"{where} failed:\n{out.stdout}{out.stderr}"
    return out.stdout


def run_curl(command: Command, servers: dict[str, DocServer]) -> str:
    argv = [_on_servers(w, servers) for w in command.argv[1:]]
    headers: dict[str, str] = {}
    body: str | None = None
    url = ""
    method = "GET"
    words = iter(argv)
    for word in words:
        if word == "-H":
            key, value = next(words).split(":", 1)
            headers[key.strip()] = value.strip()
        elif word in ("-d", "--data"):
            body, method = next(words), "POST"
        elif word == "-X":
            method = next(words)
        elif word.startswith("http"):
            url = word
        else:
            assert word in ("-s", "-N"), f"{command.where}: curl's {word} is not replayed"
    response = httpx.request(method, url, headers=headers, content=body, timeout=RUN_TIMEOUT_S)
    assert response.status_code == 200, f"{command.where}: {response.status_code} {response.text}"
    return response.text


def run_pagoda(command: Command) -> str:
    stdout = _run([sys.executable, "-m", "pagoda.cli", *command.argv[1:]], command.where)
    assert stdout.strip(), f"{command.where} printed nothing"
    return stdout


RUNNABLE: dict[str, Block | Command] = {}
for _block in PYTHON:
    RUNNABLE.setdefault(_block.code, _block)  # an example on two pages runs once
for _command in COMMANDS:
    if runs(_command):
        RUNNABLE.setdefault(_command.text, _command)


def _id(example: Block | Command) -> str:
    if isinstance(example, Block):
        return f"{example.page}:{example.line}"
    block = example.block
    return f"{block.page}:{block.line}:{program(example.argv)}#{example.index}"


@pytest.fixture(scope="module")
def results(smollm2_path: str) -> Iterator[dict[str, concurrent.futures.Future[str]]]:
    """Every runnable example started at once, three at a time, beside the servers."""
    servers = {
        DOC_SERVER: DocServer(),
        POOLING_SERVER: DocServer(("--runner", "pooling")),
        RERANK_SERVER: DocServer(("--hf-overrides", RERANKER)),
    }
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=3)
    futures: dict[str, concurrent.futures.Future[str]] = {}
    # the ones that need no server first, while it starts
    for _text, example in sorted(RUNNABLE.items(), key=lambda kv: uses_server(kv[0])):
        if isinstance(example, Block):
            futures[_id(example)] = pool.submit(run_python, example, servers)
        elif program(example.argv) == "curl":
            futures[_id(example)] = pool.submit(run_curl, example, servers)
        else:
            futures[_id(example)] = pool.submit(run_pagoda, example)
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)
    for server in servers.values():
        server.stop()


@pytest.mark.parametrize("example_id", sorted({_id(e) for e in RUNNABLE.values()}))
def test_the_example_runs(
    example_id: str, results: dict[str, concurrent.futures.Future[str]]
) -> None:
    results[example_id].result(timeout=RUN_TIMEOUT_S * 2)


def _excerpt(block: Block) -> Path | None:
    first = block.code.splitlines()[0]
    match = re.fullmatch(r"#\s*([\w/.-]+\.py)\s*", first)
    return ROOT / match.group(1) if match and (ROOT / match.group(1)).is_file() else None


def _code_tree(source: str) -> str:
    body = ast.parse(source).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the module docstring
    body = [n for n in body if not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
    return ast.dump(ast.Module(body=body, type_ignores=[]))


@pytest.mark.parametrize("block", [b for b in PYTHON if _excerpt(b)], ids=_id)
def test_a_file_shown_is_the_file(block: Block) -> None:
    path = _excerpt(block)
    assert path is not None
    assert _code_tree(block.code) == _code_tree(path.read_text()), (
        f"{block.page}:{block.line} shows {path.relative_to(ROOT)}, which has changed"
    )


def test_python_blocks_are_programs() -> None:
    """Each python block compiles alone (a fragment would need a setup the test does not give)."""
    for block in PYTHON:
        compile(block.code, f"{block.page}:{block.line}", "exec")


# --- the size of the core --------------------------------------------------------------------


def _lines(paths: list[Path]) -> int:
    return sum(len(p.read_text().splitlines()) for p in paths)


def tree_sizes() -> dict[str, int]:
    pkg = ROOT / "pagoda"
    outside = ("bench", "server", "scaleout")
    core = [
        p
        for p in pkg.rglob("*.py")
        if p.relative_to(pkg).parts[0] not in outside and p != pkg / "cli.py"
    ]
    return {"core": _lines(core), "server": _lines(list((pkg / "server").rglob("*.py")))}


def _stated(text: str, page: str) -> dict[str, int]:
    section = text.split("## Size", 1)[1]
    core = re.search(r"engine core .*? is\s+about\s+([\d,]+)\s+lines", section, flags=re.S)
    server = re.search(r"server\s.*?adds\s+about\s+([\d,]+)", section, flags=re.S)
    assert core and server, f"{page}: the size section does not state the core and the server"
    return {
        "core": int(core.group(1).replace(",", "")),
        "server": int(server.group(1).replace(",", "")),
    }


@pytest.mark.parametrize("page", ["README.md", "docs/architecture.md"])
def test_the_stated_size_of_the_core_is_current(page: str) -> None:
    actual = tree_sizes()
    stated = _stated((ROOT / page).read_text(), page)
    for part, lines in actual.items():
        assert abs(stated[part] - lines) <= 0.1 * lines, (
            f"{page} says the {part} is about {stated[part]} lines; it is {lines}: update it"
        )


def test_json_in_examples_is_json() -> None:
    """The JSON bodies of curl lines parse (a quoting slip would send garbage)."""
    for command in COMMANDS:
        if program(command.argv) == "curl" and "-d" in command.argv:
            json.loads(command.argv[command.argv.index("-d") + 1])
