"""The tree's dependency rules (docs/architecture.md), read from the imports with `ast`.

Parts, highest first; a part imports only parts below it, its own modules and the ground:

    cli.py, __init__.py (face) -> scaleout/ -> server/, bench/ -> client/ -> engine/
    -> distributed/ -> runner/ -> spec_decode/ -> loading/ -> models/ -> layers/ -> kernels/

scaleout/ (the Ray Serve app, its routing and autoscaling) runs pagoda's server in each replica,
so it ranks above the server; distributed/ (the parallel ranks and the KV connector) sits below
the engine, which starts them. Within the network a model builds on layers and a layer on
kernels, never the other way: the paged cache's tensors (KVCache, kernels/paged_cache.py) are
what the kernels read, below the layers that write them. No module is an exception to its
folder.

The ground is plain data that every part may read: config.py, sampling_params.py, outputs.py,
engine_args.py, version.py and scheduling/messages.py (the contract). Besides the direction:
- no import cycles between modules (TYPE_CHECKING and function-level imports count too);
- scheduling/ and the plain-data modules at the root never import torch or triton;
- scheduling/ imports only the ground; only engine/ reads the rest of scheduling/;
- the server reads nothing of scheduling/, the contract included: it talks to the client.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "pagoda"

RANKS = {
    "face": 7,
    "scaleout": 6.5,  # the Ray Serve app: replicas of the server
    "server": 6,
    "bench": 6,
    "client": 5,
    "engine": 4,
    "distributed": 3.5,  # the tensor-parallel ranks: the engine starts them, each runs a runner
    "runner": 3,
    "spec_decode": 2.5,  # the proposers, which the runner calls; a draft model is a network
    "loading": 2,
    "models": 1.3,  # the network: models, then layers, then kernels
    "layers": 1.2,
    "kernels": 1.1,
    "scheduling": 0,
    "ground": 0,
}
PLAIN_ROOT = {
    "pagoda.config",
    "pagoda.model_config",
    "pagoda.kv_transfer_config",
    "pagoda.speculative_config",
    "pagoda.pooler_config",
    "pagoda.lora_request",
    "pagoda.flag_json",
    "pagoda.sampling_params",
    "pagoda.structured_outputs",
    "pagoda.outputs",
    "pagoda.engine_args",
    "pagoda.version",
}
CONTRACT = "pagoda.scheduling.messages"
TENSOR_LIBS = {"torch", "triton", "numpy"}


def part_of(module: str) -> str:
    parts = module.split(".")
    if module in PLAIN_ROOT or module == CONTRACT:
        return "ground"
    if module in ("pagoda", "pagoda.cli"):
        return "face"
    top = parts[1]
    if top not in RANKS:
        raise AssertionError(f"{module} belongs to no part: add its folder to RANKS")
    return top


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    names = list(rel.parts)
    if names[-1] == "__init__":
        names.pop()
    return ".".join(names)


def resolve(name: str, modules: set[str]) -> str | None:
    """The pagoda module that `import name` / `from name import ...` loads last."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(path: Path, modules: set[str]) -> tuple[set[str], set[str]]:
    """(pagoda modules, top-level third-party packages) the file imports, anywhere in it."""
    tree = ast.parse(path.read_text(), str(path))
    ours: set[str] = set()
    libs: set[str] = set()
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            # `from pkg import sub` imports the submodule pkg.sub when there is one.
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "pagoda":
                found = resolve(target, modules)
                if found is not None and found != here:
                    ours.add(found)
            else:
                libs.add(target.split(".")[0])
    # `from pkg import sub` added both pkg and pkg.sub: keep pkg only when a name came from it.
    return ours, libs


def graph() -> dict[str, tuple[set[str], set[str]]]:
    files = sorted(ROOT.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imports_of(f, modules) for f in files}


def allowed(src: str, dst: str) -> str | None:
    """None if src may import dst, else why not."""
    a, b = part_of(src), part_of(dst)
    if a == "server" and dst == CONTRACT:
        return "the server talks to the engine through the client only, not the contract"
    if b == "ground" or a == b:
        if a == "ground" and dst not in PLAIN_ROOT and dst != CONTRACT:
            return "the ground reads only the ground"
        return None
    if a in ("ground", "scheduling"):
        return f"{a} reads only the ground (plain data), not {b}"
    if b == "scheduling" and a != "engine":
        return "only engine/ reads scheduling/ beyond the contract (scheduling/messages.py)"
    if RANKS[b] >= RANKS[a]:
        return f"{a} must not import {b}: dependencies point down"
    return None


def test_dependencies_point_one_way() -> None:
    bad = []
    for src, (deps, _) in graph().items():
        for dst in sorted(deps):
            if dst == "pagoda" and src != "pagoda":
                bad.append(f"{src} -> pagoda: import from the defining module, not the package")
                continue
            if dst.startswith(src + ".") and src != "pagoda":  # a package and its own modules
                continue
            why = allowed(src, dst)
            if why is not None:
                bad.append(f"{src} -> {dst}: {why}")
    assert not bad, "\n".join(bad)


def test_no_import_cycles() -> None:
    edges = {m: {d for d in deps if not m.startswith(d + ".")} for m, (deps, _) in graph().items()}
    cycles = [c for c in strongly_connected(edges) if len(c) > 1]
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


@pytest.mark.parametrize("module_prefix", ["pagoda.scheduling", *sorted(PLAIN_ROOT)])
def test_plain_data_never_imports_tensors(module_prefix: str) -> None:
    found = {
        m: libs & TENSOR_LIBS
        for m, (_, libs) in graph().items()
        if (m == module_prefix or m.startswith(module_prefix + ".")) and libs & TENSOR_LIBS
    }
    assert not found, f"plain-data modules import tensor libraries: {found}"


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                out.append(component)
    return out


def test_the_rules_catch_what_they_forbid() -> None:
    """The checker itself: each forbidden arrow is reported, an allowed one is not."""
    assert allowed("pagoda.runner.model_runner", "pagoda.engine.core") is not None
    assert allowed("pagoda.layers.attention", "pagoda.runner.step_inputs") is not None
    assert allowed("pagoda.kernels.kv_cache", "pagoda.layers.kv_cache") is not None
    assert allowed("pagoda.layers.linear", "pagoda.models.base") is not None
    assert allowed("pagoda.server.app", "pagoda.scaleout.ray_serve") is not None
    assert allowed("pagoda.scaleout.ray_serve", "pagoda.server.auth") is None
    assert allowed("pagoda.engine.core", "pagoda.distributed.workers") is None
    assert allowed("pagoda.scheduling.scheduler", "pagoda.runner.sampler") is not None
    assert allowed("pagoda.client.llm", "pagoda.server.app") is not None
    assert allowed("pagoda.server.app", "pagoda.scheduling.scheduler") is not None
    assert allowed("pagoda.config", "pagoda.layers.kv_cache") is not None
    assert allowed("pagoda.server.app", "pagoda.client.async_client") is None
    assert allowed("pagoda.runner.model_runner", CONTRACT) is None
    assert allowed("pagoda.engine.core", "pagoda.scheduling.scheduler") is None
    assert allowed("pagoda.server.metrics", CONTRACT) is not None
    assert [sorted(c) for c in strongly_connected({"a": {"b"}, "b": {"a"}, "c": set()})] == [
        ["c"],
        ["a", "b"],
    ] or [sorted(c) for c in strongly_connected({"a": {"b"}, "b": {"a"}, "c": set()})] == [
        ["a", "b"],
        ["c"],
    ]


def test_small_files_stay_small() -> None:
    """No module over 500 lines (docs/architecture.md): split by noun before it grows past."""
    big = {
        str(p.relative_to(ROOT.parent)): n
        for p in ROOT.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not big, f"modules over 500 lines: {big}"


def _tree_blocks(doc: str) -> dict[str, str]:
    """docs/architecture.md's tree: each top-level entry (`cli.py`, `server/`, ...) and its text."""
    tree = doc.split("## The tree", 1)[1].split("```")[1]
    blocks: dict[str, str] = {}
    name = ""
    for line in tree.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            name = line.split()[0]
            blocks[name] = line[len(name) + 2 :]
        elif name:
            blocks[name] += "\n" + line
    return blocks


def test_the_architecture_page_names_every_module() -> None:
    """Every module of pagoda/ is named (its file name) in docs/architecture.md's tree, under its
    top folder."""
    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    blocks = _tree_blocks(doc)
    missing = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if path.name in ("__init__.py", "__main__.py") and len(rel.parts) > 1:
            continue
        top = rel.parts[0] if len(rel.parts) == 1 else rel.parts[0] + "/"
        text = blocks.get(top)
        named = re.search(rf"\b{re.escape(path.name)}", text or "")
        if text is None or (len(rel.parts) > 1 and named is None):
            missing.append(str(rel))
    assert not missing, f"docs/architecture.md's tree does not name: {missing}"


EXECUTORS = {"WorkerGroup", "LocalExecutor", "ConnectedExecutor", "ModelRunner"}


def test_no_code_asks_which_executor_it_has() -> None:
    """The engine (and everything above it) steps on runner/executor.py's Executor without an
    isinstance on WorkerGroup, LocalExecutor, ConnectedExecutor or ModelRunner: 0 sites in
    pagoda/."""
    sites = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                if names & EXECUTORS:
                    sites.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not sites, f"isinstance on an executor: {sites}"


def _is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    def is_jit(d: ast.expr) -> bool:
        target = d.func if isinstance(d, ast.Call) else d
        return isinstance(target, ast.Attribute) and target.attr == "jit"

    return any(is_jit(d) for d in node.decorator_list)


def test_functions_stay_short() -> None:
    """No function over 60 lines but Triton kernels (one body the compiler sees whole): split
    by step, and flag lists become tables."""
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > 60 and not _is_triton_kernel(node):
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} {lines}")
    assert not long, "functions over 60 lines:\n" + "\n".join(long)
