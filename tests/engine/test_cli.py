"""`pagoda generate` and `pagoda chat` as a user runs them (a real process); the error path
through main() in this process."""

from __future__ import annotations

import json
import subprocess
import sys

from pagoda import LLM, SamplingParams
from pagoda.cli import main


def _pagoda(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pagoda.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_generate_json_matches_offline_llm(tiny_model_dir) -> None:
    path = tiny_model_dir("llama")
    proc = _pagoda(
        "generate",
        "--model",
        path,
        "--prompt",
        "Hello world",
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        "--ignore-eos",
        "--num-gpu-blocks-override",
        "32",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = LLM(path, num_gpu_blocks_override=32).generate(
        "Hello world", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    )
    assert record["token_ids"] == expected[0].outputs[0].token_ids
    assert record["text"] == expected[0].outputs[0].text
    assert record["finish_reason"] == "length"


def test_generate_bad_flag_value_is_a_clear_error(tiny_model_dir, capsys) -> None:
    # In this process (main() as `pagoda` calls it): an exception main() let through would fail
    # the test, as a traceback would in a real process, without the interpreter start-up (~5 s).
    args = ["generate", "--model", tiny_model_dir("llama"), "--prompt", "x", "--top-p", "2"]
    args += ["--num-gpu-blocks-override", "32"]
    assert main(args) == 2
    assert "top_p" in capsys.readouterr().err


def test_chat_streams_replies_until_eof(tiny_model_dir) -> None:
    proc = _pagoda(
        "chat",
        "--model",
        tiny_model_dir("llama"),
        "--max-tokens",
        "5",
        "--temperature",
        "0",
        "--ignore-eos",
        stdin="Hi there\nAnd again\n",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("> ") == 3  # two turns answered, then the prompt that reads EOF
