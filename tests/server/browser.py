"""Headless Chromium for the browser tests (pagoda/bench/browser.py: Debian's `chromium`, which
`make test` installs, driven by Playwright). tests/server/conftest.py registers the fixtures
`browser` (one per module) and `open_page`."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pagoda.bench.browser import launch_chromium


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if shutil.which("chromium") is None:
        if os.environ.get("CI"):
            pytest.fail("Debian's chromium is not installed: `make test` installs it")
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; make test does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = launch_chromium(playwright)
        yield launched
        launched.close()


class Page:
    """A page on a server's /ui that records every JavaScript error it logs."""

    def __init__(self, browser: Any, url: str) -> None:
        self.context = browser.new_context(viewport={"width": 1400, "height": 1000})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.on(
            "console",
            lambda m: self.errors.append(f"console: {m.text}") if m.type == "error" else None,
        )
        self.page.goto(url + "/ui")

    def data(self, selector: str, key: str) -> Any:
        return self.page.eval_on_selector(selector, f"e => e.dataset.{key}")

    def shot(self, name: str, tmp_path: Path) -> Path:
        folder = Path(os.environ.get("PAGODA_UI_SCREENSHOTS") or tmp_path)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        self.page.screenshot(path=str(path), full_page=True)
        assert path.stat().st_size > 10_000  # a rendered page, not an empty canvas
        return path


@pytest.fixture
def open_page(browser: Any) -> Iterator[Callable[[str], Page]]:
    pages: list[Page] = []

    def opened(url: str) -> Page:
        pages.append(Page(browser, url))
        return pages[-1]

    yield opened
    for p in pages:
        p.context.close()
