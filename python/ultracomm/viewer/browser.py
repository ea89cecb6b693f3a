"""A headless Chromium for screenshots of a report (and for the tests): the system's browser
(Debian's ``chromium``) driven by Playwright's Python API.  Nothing is downloaded: Playwright's
own browser builds are never used, and the flags below keep Chromium off the network."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Optional, Union
from ..errors import UltracommError

__all__ = ["CHROMIUM_ARGS", "find_chromium", "launch", "screenshot"]

#: Headless, no sandbox (root in containers), no GPU, and no background connections (a closed
#: network otherwise sees Chromium's update, sync and component requests fail, many at a time).
CHROMIUM_ARGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)


def find_chromium() -> Optional[str]:
    """Path of the system's Chromium (``chromium``, ``chromium-browser``), or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def launch(playwright: Any, executable: Optional[str] = None) -> Any:
    """A Playwright ``Browser`` on the system's Chromium.  Raises RuntimeError naming what to
    install when there is none."""
    exe = executable or find_chromium()
    if exe is None:
        raise UltracommError(
            "no Chromium found: install the distribution's package (Debian: apt-get install "
            "chromium); Playwright's own browser downloads are not used"
        )
    return playwright.chromium.launch(executable_path=exe, args=list(CHROMIUM_ARGS))


def screenshot(
    html: Union[str, os.PathLike], png: Union[str, os.PathLike], *, width: int = 1400, height: int = 1000
) -> list[str]:
    """Open ``html`` (a file), wait until the viewer has drawn, and write a full-page PNG.
    Returns the console errors and warnings the page produced (empty when clean)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise UltracommError(
            "screenshots need Playwright's Python package: pip install playwright "
            "(no browser download: the system's Chromium is used)"
        ) from None
    msgs: list[str] = []
    with sync_playwright() as p:
        browser = launch(p)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.on("console", lambda m: msgs.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: msgs.append(f"pageerror: {e}"))
            page.goto(Path(html).resolve().as_uri())
            page.wait_for_selector("body[data-ready]", timeout=60_000)
            page.mouse.move(0, 0)
            page.screenshot(path=str(png), full_page=True)
        finally:
            browser.close()
    return msgs
