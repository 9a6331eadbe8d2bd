"""Many concurrent streaming clients: each gets exactly its own greedy output, and the engine
batches them: the requests' own timelines (GET /v1/requests/{id}/explain) show steps that ran
several of them, read after the run, not caught by polling a gauge while it lasts."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import pytest

from pagoda import LLM, SamplingParams
from tests.server.conftest import ServerProcess

NUM_CLIENTS = 32
MAX_TOKENS = 64  # with ignore_eos, long enough for the requests to overlap on the tiny model
RUNNING = "pagoda:num_requests_running"
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


def prompts(n: int) -> list[str]:
    rng = random.Random(0)
    return [f"Client {i}: " + " ".join(rng.choices(WORDS, k=rng.randint(2, 40))) for i in range(n)]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: str) -> list[str]:
    """The greedy texts of the offline engine on the same model, one prompt at a time."""
    llm = LLM(tiny_llama_dir, num_gpu_blocks_override=512)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [
        llm.generate(p, params, use_tqdm=False)[0].outputs[0].text for p in prompts(NUM_CLIENTS)
    ]


async def _run_clients(server: ServerProcess, model: str) -> list[dict[str, object]]:
    client = server.async_client(timeout=120)

    async def one(prompt: str) -> dict[str, object]:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, reasons, usage, rid = "", [], None, ""
        async for chunk in stream:
            rid = chunk.id
            for c in chunk.choices:
                assert c.index == 0
                text += c.text
                if c.finish_reason is not None:
                    reasons.append(c.finish_reason)
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return {"text": text, "reasons": reasons, "completion_tokens": usage, "id": rid}

    try:
        return list(await asyncio.gather(*(one(p) for p in prompts(NUM_CLIENTS))))
    finally:
        await client.close()


def _steps(timeline: list[dict[str, object]]) -> set[int]:
    """The engine steps a sample was scheduled in (prefill chunks and decode runs)."""
    steps: set[int] = set()
    for entry in timeline:
        if entry["event"] in ("prefill", "decode"):
            first = int(entry["step"])  # type: ignore[call-overload]
            steps.update(range(first, first + int(entry["num_steps"])))  # type: ignore[call-overload]
    return steps


def test_concurrent_streams_get_their_own_greedy_output(
    tiny_server: ServerProcess, expected: list[str]
) -> None:
    model = str(tiny_server.get("/v1/models").json()["data"][0]["id"])
    results = asyncio.run(_run_clients(tiny_server, model))
    for i, (result, text) in enumerate(zip(results, expected)):
        assert result["reasons"] == ["length"], i
        assert result["completion_tokens"] == MAX_TOKENS, i
        assert result["text"] == text, i
    per_step: Counter[int] = Counter()
    for result in results:
        explained = tiny_server.get(f"/v1/requests/{result['id']}/explain").json()
        [sample] = explained["samples"]
        assert sample["num_decode_steps"] == MAX_TOKENS - 1
        per_step.update(_steps(sample["timeline"]))
    most = max(per_step.values())
    print(f"at most {most} of {NUM_CLIENTS} requests ran in one step")
    assert most > 1, "the engine never ran two requests in one step"
    # Everything finished: the gauge goes back to zero.
    deadline = time.monotonic() + 60
    while tiny_server.metric(RUNNING) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tiny_server.metric(RUNNING) == 0
