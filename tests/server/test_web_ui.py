"""GET /ui (server/webui.py, server/static) on a real server, in a real browser: headless
Chromium from Debian's `chromium` package driven by Playwright (its own browser download does not
work on these machines; `make test` installs both).

- The files: served open (also on a keyed server), with their media types, and nothing in them
  loads from outside the server (no CDN: the machines have no internet).
- In the browser: a chat streams into the page and equals the API's own greedy answer; a load
  started from the page shows in the block view (blocks held, coloured by owner), the queues and
  the plots, and preempts (the load needs more blocks than the pool has); the last request's
  explanation shows its timeline. A keyed server's page asks for the key and goes live with it.
  Any JavaScript error the page logs fails the test. Screenshots go to $PAGODA_UI_SCREENSHOTS
  (else the test's tmp dir).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import httpx

from pagoda.server.webui import ASSETS
from tests.server.browser import Page
from tests.server.conftest import SMALL_POOL, ServerProcess

BLOCKS = int(SMALL_POOL[1])
CHAT_TOKENS = 128


def _model(server: ServerProcess) -> str:
    return str(server.get("/v1/models").json()["data"][0]["id"])


def test_the_files_are_served_open_and_load_nothing_from_outside(
    start_server: Callable[..., ServerProcess], tiny_llama_dir: str
) -> None:
    server = start_server(tiny_llama_dir, *SMALL_POOL, api_key="sk-files")
    for name, media_type in [("", ASSETS["index.html"])] + [
        (f"/{n}", t) for n, t in ASSETS.items()
    ]:
        r = httpx.get(server.url + "/ui" + name)  # no key: the files are open
        assert r.status_code == 200, (name, r.text)
        assert r.headers["content-type"] == media_type
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", r.text, re.I), name
    assert httpx.get(server.url + "/v1/models").status_code == 401  # the API is still guarded
    missing = server.get("/ui/secrets.txt")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "NotFoundError"


# ---- in the browser ----------------------------------------------------------------------------
def test_a_chat_streams_into_the_page_and_a_load_shows_live(
    tiny_server: ServerProcess, open_page: Callable[[str], Page], tmp_path: Path
) -> None:
    ui = open_page(tiny_server.url)
    page = ui.page
    page.wait_for_selector("#feed-state.live", timeout=30_000)
    assert page.text_content("#model") == _model(tiny_server)
    assert int(ui.data("#pool", "blocks")) == BLOCKS

    # a chat, greedy: the streamed text equals the API's answer to the same request. The server
    # coalesces the deltas a slow reader has not taken yet (async_client.py): on a loaded CI
    # machine a 24-token answer once arrived as one chunk; 128 tokens arrived in 127 here.
    for field, value in {"temperature": "0", "max_tokens": str(CHAT_TOKENS)}.items():
        page.fill(f"#{field}", value)
    page.fill("#prompt", "Tell me about the sea.")
    page.click("#send")
    page.wait_for_function("document.querySelector('#request-info').textContent.includes('tokens')")
    streamed = page.text_content(".message.assistant .content")
    want = tiny_server.post(
        "/v1/chat/completions",
        {
            "model": _model(tiny_server),
            "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "temperature": 0,
            "max_tokens": CHAT_TOKENS,
        },
    ).json()
    assert streamed == want["choices"][0]["message"]["content"]
    assert int(ui.data(".message.assistant .content", "chunks")) > 1  # it arrived in pieces
    explained_id = page.text_content("#request-info").split(":")[0]
    assert explained_id.startswith("chatcmpl-")

    # a load from the page: 32 requests of 256 tokens need more KV blocks than the pool holds
    page.fill("#load-n", "32")
    page.fill("#load-tokens", "256")
    page.click("#load")
    page.wait_for_function(
        "document.querySelector('#pool').dataset.held > 0"
        " && document.querySelector('#pool').dataset.owners > 1"
        " && document.querySelector('#pool').dataset.shared > 0"
        " && document.querySelectorAll('#queues tr[data-queue=running]').length > 1",
        timeout=60_000,
    )
    ui.shot("ui-under-load.png", tmp_path)
    throughput = "[data-plot^='throughput']"
    page.wait_for_function(
        f'JSON.parse(document.querySelector("{throughput}").dataset.latest).generation > 0',
        timeout=60_000,
    )
    page.wait_for_function(
        "document.querySelector('#load-state').textContent.startsWith('32 / 32 done')",
        timeout=120_000,
    )
    page.wait_for_function(
        "document.querySelectorAll('#queues tbody tr').length === 0"
        " && document.querySelector('#pool').dataset.held == 0",
        timeout=30_000,
    )
    assert json.loads(ui.data("[data-plot='preemptions (total)']", "latest"))["preemptions"] > 0
    assert json.loads(ui.data("[data-plot='E2E latency']", "latest"))["p50"] > 0
    # one sample a feed tick while the load ran: several, however fast the CPU (a Zen 5 ran the
    # load in 5 ticks; fresh-clone CI, 2026-12-01)
    assert int(ui.data("[data-plot='TTFT']", "samples")) > 2

    # the chat's explanation (the load's requests are not the page's "last request")
    page.click("#explain")
    page.wait_for_selector("#explanation tr[data-event=finished]")
    events = page.eval_on_selector_all(
        "#explanation tr[data-event]", "rs => rs.map(r => r.dataset.event)"
    )
    assert events[0] == "arrived" and "prefill" in events and "decode" in events
    assert explained_id in page.text_content("#explanation .summary")
    ui.shot("ui-after-load.png", tmp_path)
    assert ui.errors == []


def test_a_keyed_server_s_page_asks_for_the_key(
    start_server: Callable[..., ServerProcess],
    tiny_llama_dir: str,
    open_page: Callable[[str], Page],
) -> None:
    server = start_server(tiny_llama_dir, *SMALL_POOL, api_key="sk-page")
    ui = open_page(server.url)
    page = ui.page
    page.wait_for_function("document.querySelector('#feed-state').textContent === 'API key needed'")
    page.fill("#api-key", "sk-page")
    page.dispatch_event("#api-key", "change")
    page.wait_for_selector("#feed-state.live", timeout=30_000)
    assert page.text_content("#model") == _model(server)
    # the 401s the page met before the key are answers it handled, not script errors
    assert [e for e in ui.errors if "401" not in e] == []
