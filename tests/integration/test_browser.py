"""A browser in a sandbox, driven from outside over the bus: the built-in `browser` image runs
headless Chromium next to a small web app; the unmodified `playwright` package connects to its
DevTools endpoint through `sb.forward(9222)` (connect_over_cdp, no browser download), navigates,
fills and submits the app's form, reads the page its JavaScript wrote, and takes a PNG screenshot;
the app's own state, read host-side from the sandbox, shows the order the browser placed."""
from __future__ import annotations

import asyncio
import json
import shlex
import struct

import pytest
import pytest_asyncio
from playwright.async_api import Error as PlaywrightError
from playwright.async_api import async_playwright

from corral_common.contract import subjects
from corral_common.contract.images import ImportReply, ImportRequest
from corral_sdk import AsyncClient
from corral_sdk.webapp import APP_PATH, APP_PORT, APP_SOURCE, CHROMIUM_FLAGS, DEVTOOLS_PORT, ORDERS_PATH

from ..conftest import ensure_builtin_images, running_stack

pytestmark = pytest.mark.timeout(900)


@pytest_asyncio.fixture(scope="module")
async def browser_sandbox():
    await asyncio.to_thread(ensure_builtin_images)
    async with running_stack(nodes=1, monitor=False, env_builder=False) as s:
        c = await AsyncClient.connect(s.url)
        # built on first use (~70 s: debootstrap of debian + chromium), a no-op once on the machine
        await c.request(subjects.IMAGE_IMPORT, ImportRequest(name="browser", source="builtin"), ImportReply, timeout=900)
        sb = await c.create(image="browser", cpu=1, memory_mb=1536, ttl_s=1200)
        await sb.files.write(APP_PATH, APP_SOURCE)
        r = await sb.exec(f"python3 {APP_PATH} >/tmp/app.log 2>&1 & "
                          f"{shlex.join(['chromium', *CHROMIUM_FLAGS])} >/tmp/chromium.log 2>&1 & "
                          "for i in $(seq 300); do "
                          f"python3 -c 'import urllib.request as u; u.urlopen(\"http://127.0.0.1:{DEVTOOLS_PORT}/json/version\"); "
                          f"u.urlopen(\"http://127.0.0.1:{APP_PORT}/\")' 2>/dev/null && exit 0; sleep 0.2; done; "
                          "cat /tmp/chromium.log /tmp/app.log; exit 1", session="browser", timeout_s=90)
        assert r.exit_code == 0, r
        yield c, sb
        await sb.destroy()
        await c.close()


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:16]
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


async def test_playwright_drives_chromium_in_a_sandbox_over_the_bus(browser_sandbox):
    c, sb = browser_sandbox
    async with await sb.forward(DEVTOOLS_PORT) as fwd, async_playwright() as pw:
        browser = await pw.chromium.connect_over_cdp(f"http://{fwd.address}", timeout=60_000)
        try:
            assert browser.version  # the sandbox's Chromium answered
            ctx = browser.contexts[0] if browser.contexts else await browser.new_context()
            page = await ctx.new_page()
            await page.set_viewport_size({"width": 800, "height": 600})
            # the app's address as the browser sees it: the sandbox's own loopback
            await page.goto(f"http://127.0.0.1:{APP_PORT}/", timeout=30_000)
            assert await page.title() == "Widget shop"
            await page.fill("#name", "Ada <Lovelace>")
            await page.fill("#qty", "3")
            await page.click("#submit")
            await page.wait_for_selector("#total", timeout=30_000)
            assert await page.text_content("#result") == "Order #1: 3 widget(s) for Ada <Lovelace>"
            assert await page.text_content("#total") == "Total: 21 EUR"  # written by the page's script
            shot = await page.screenshot(full_page=False)
            assert png_size(shot) == (800, 600)
            assert len(shot) > 2000  # rendered text, not an empty frame
        finally:
            await browser.close()
    # the server's own state, read outside the sandbox's processes
    orders = [json.loads(line) for line in (await sb.files.read_text(ORDERS_PATH)).splitlines()]
    assert orders == [{"id": 1, "name": "Ada <Lovelace>", "qty": 3}]


async def test_the_browser_is_not_a_route_into_the_sandbox_or_out(browser_sandbox):
    """Chromium in a sandbox reaches the sandbox's loopback and nothing else."""
    c, sb = browser_sandbox
    async with await sb.forward(DEVTOOLS_PORT) as fwd, async_playwright() as pw:
        browser = await pw.chromium.connect_over_cdp(f"http://{fwd.address}", timeout=60_000)
        try:
            page = await (browser.contexts[0] if browser.contexts else await browser.new_context()).new_page()
            with pytest.raises(PlaywrightError):
                await page.goto("http://1.1.1.1/", timeout=15_000)
        finally:
            await browser.close()
