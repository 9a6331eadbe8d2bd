"""`pagoda serve --speculative-config`: n-gram speculation behind the OpenAI API, streaming
several tokens per chunk, its counters in /metrics and its part of the log line; a bad config
stops the server at start with a message naming the field."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from tests.server.conftest import SMALL_POOL, ServerProcess

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
PASSAGE = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the "
    "wick, polished the great lens, and watched the ships pass safely along the rocky coast."
)


def test_ngram_server_streams_and_counts(
    start_server: Callable[..., ServerProcess], smollm2_path: str
) -> None:
    server = start_server(
        None, *SMALL_POOL, "--max-model-len", "1024", "--speculative-config", NGRAM
    )
    client = server.client()
    model = str(server.get("/v1/models").json()["data"][0]["id"])
    messages: Any = [{"role": "user", "content": f"Repeat this text exactly:\n\n{PASSAGE}"}]
    whole = client.chat.completions.create(
        model=model, messages=messages, temperature=0.0, max_tokens=48
    )
    text = whole.choices[0].message.content
    assert text and "lighthouse keeper" in text
    chunks = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=model, messages=messages, temperature=0.0, max_tokens=48, stream=True
        )
        if c.choices
    ]
    assert "".join(chunks) == text
    drafted = server.metric("pagoda:spec_decode_num_draft_tokens_total")
    accepted = server.metric("pagoda:spec_decode_num_accepted_tokens_total")
    assert server.metric("pagoda:spec_decode_num_drafts_total") > 0
    assert drafted >= accepted > 0
    assert server.metric("pagoda:spec_decode_num_accepted_tokens_per_pos_total") > 0


def test_bad_speculative_config_stops_the_server() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagoda.cli",
            "serve",
            "--speculative-config",
            '{"method": "ngram"}',
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "num_speculative_tokens is required" in proc.stderr
