"""Headless Chromium for the browser view's tests and benchmarks (GET /ui): Debian's `chromium`
(`make browser` installs it), driven by Playwright, whose own browser download does not work on
machines without internet. Playwright is a test extra, imported only when a browser starts."""

from __future__ import annotations

import shutil
from typing import Any

# Chromium on a machine with a closed network: no background connections; no sandbox (root).
CHROMIUM_ARGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def launch_chromium(playwright: Any) -> Any:
    """A headless Debian chromium under `playwright` (sync_playwright()'s object); ValueError
    when it is not installed."""
    path = shutil.which("chromium")
    if path is None:
        raise ValueError(
            "Debian's chromium is not installed (apt-get install chromium; make browser)"
        )
    return playwright.chromium.launch(executable_path=path, args=list(CHROMIUM_ARGS))
