"""Many concurrent streaming clients: each gets exactly its own greedy output, and the engine
batches them (pagoda:num_requests_running > 1 while they run)."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
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


async def _poll_running(server: ServerProcess, seen: list[float], stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        while not stop.is_set():
            for line in (await http.get("/metrics")).text.splitlines():
                if line.startswith(RUNNING + "{") or line.startswith(RUNNING + " "):
                    seen.append(float(line.rsplit(" ", 1)[1]))
            await asyncio.sleep(0.01)


async def _run_clients(server: ServerProcess, model: str) -> tuple[list[dict[str, object]], float]:
    client = server.async_client(timeout=120)

    async def one(prompt: str) -> dict[str, object]:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        text, reasons, usage = "", [], None
        async for chunk in stream:
            for c in chunk.choices:
                assert c.index == 0
                text += c.text
                if c.finish_reason is not None:
                    reasons.append(c.finish_reason)
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return {"text": text, "reasons": reasons, "completion_tokens": usage}

    seen: list[float] = []
    stop = asyncio.Event()
    poller = asyncio.create_task(_poll_running(server, seen, stop))
    try:
        results = await asyncio.gather(*(one(p) for p in prompts(NUM_CLIENTS)))
    finally:
        stop.set()
        await poller
        await client.close()
    return list(results), max(seen, default=0.0)


def test_concurrent_streams_get_their_own_greedy_output(
    tiny_server: ServerProcess, expected: list[str]
) -> None:
    model = str(tiny_server.get("/v1/models").json()["data"][0]["id"])
    results, max_running = asyncio.run(_run_clients(tiny_server, model))
    for i, (result, text) in enumerate(zip(results, expected)):
        assert result["reasons"] == ["length"], i
        assert result["completion_tokens"] == MAX_TOKENS, i
        assert result["text"] == text, i
    print(f"max {RUNNING} observed: {max_running:.0f} of {NUM_CLIENTS} clients")
    assert max_running > 1, "the engine never ran two requests at once"
    # Everything finished: the gauge goes back to zero.
    deadline = time.monotonic() + 10
    while tiny_server.metric(RUNNING) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tiny_server.metric(RUNNING) == 0
