"""The demo's web environment: a web agent's task graded on the app's own server state.

A rollout runs the widget shop (webapp.py) as the harness and Chromium as the agent's browser,
both started by `envs.rollout` (EnvSpec.services); the agent drives the browser from outside over
the bus (`sb.forward(9222)`, playwright's connect_over_cdp) and must place one order. The grader
reads the shop's state file, which only the shop (a harness process) can write: the agent's root
has no capabilities, so it can neither write the harness's file nor make one owned by the
harness, and a file it puts in the state's place is discarded as `service_state_forged`
(EnvSpec.service_state). The policies say what they deserve, as the calc-median ones do."""
from __future__ import annotations

import json
import shlex

from corral_common import extras
from corral_common.contract.envs import EnvSpec, RolloutLimits, ServiceSpec, Solution

from .client import AsyncSandbox
from .demo_policies import Policy
from .webapp import APP_PATH, APP_PORT, APP_SOURCE, CHROMIUM_FLAGS, DEVTOOLS_PORT, ORDERS_PATH

WEB_ENV = "web-shop"
CUSTOMER, QUANTITY = "Ada Lovelace", 3
APP_URL = f"http://127.0.0.1:{APP_PORT}/"
TASK = (f"The widget shop runs at {APP_URL} inside the sandbox and its Chromium listens for the DevTools protocol on port "
        f"{DEVTOOLS_PORT}. Using the browser, order {QUANTITY} widgets in the name of {CUSTOMER}.")

VISIBLE_TESTS = '''import pathlib
import unittest


class TestShopPage(unittest.TestCase):
    def test_the_form_asks_for_a_name_and_a_quantity(self):
        src = pathlib.Path(__file__).resolve().parent.parent.joinpath("app.py").read_text()
        for field in ('id="name"', 'id="qty"', 'id="submit"'):
            self.assertIn(field, src)


if __name__ == "__main__":
    unittest.main()
'''

HIDDEN_TESTS = f'''import json
import unittest

ORDERS = {ORDERS_PATH!r}


class TestOrderPlaced(unittest.TestCase):
    def test_exactly_the_asked_order_was_placed(self):
        with open(ORDERS) as f:
            orders = [json.loads(line) for line in f if line.strip()]
        self.assertEqual([(o["name"], o["qty"]) for o in orders], [({CUSTOMER!r}, {QUANTITY})])


if __name__ == "__main__":
    unittest.main()
'''

_URLOPEN = "python3 -I -c 'import urllib.request as u; u.urlopen(\"http://127.0.0.1:{port}{path}\", timeout=2)'"


def shop_spec(name: str = WEB_ENV, version: str = "") -> EnvSpec:
    workdir = APP_PATH.rsplit("/", 1)[0]
    state_dir = ORDERS_PATH.rsplit("/", 1)[0]
    return EnvSpec(
        name=name, version=version, base_image="browser", workdir=workdir, description=TASK,
        files={"app.py": APP_SOURCE, "tests/__init__.py": "", "tests/test_page.py": VISIBLE_TESTS},
        # the shop (a harness process) makes its state file in a directory anyone may add to and
        # nobody may remove from but the owner (like /tmp): the file is the harness's alone
        setup=[f"mkdir -p {state_dir} && chmod 1777 {state_dir}"],
        services=[ServiceSpec(cmd=f"python3 -I {APP_PATH}", harness=True, ready=_URLOPEN.format(port=APP_PORT, path="/")),
                  ServiceSpec(cmd=shlex.join(["chromium", *CHROMIUM_FLAGS]), harness=False, ready_timeout_s=90,
                              ready=_URLOPEN.format(port=DEVTOOLS_PORT, path="/json/version"))],
        service_state=[ORDERS_PATH],
        solution_surface=[state_dir],
        test_command="python3 -m unittest discover -s tests -t . 2>&1",
        hidden_files={"tests/test_order.py": HIDDEN_TESTS},
        solution=Solution(files={ORDERS_PATH: json.dumps({"id": 1, "name": CUSTOMER, "qty": QUANTITY}) + "\n"}),
        grader_files=["tests/test_page.py", "tests/__init__.py"],
        limits=RolloutLimits(cpu=1.0, memory_mb=1536, disk_mb=256, pids_max=512, ttl_s=1800),
        labels={"suite": "demo"},
    )


async def order_in_browser(sb: AsyncSandbox, name: str, qty: int) -> str:
    """Drive the sandbox's Chromium through a port forward over the bus, as a web agent would:
    open the shop, fill the form, submit, and return the confirmation the page's script wrote."""
    pw = extras.require("playwright.async_api", "browser", "driving the sandbox's browser")
    async with await sb.forward(DEVTOOLS_PORT) as fwd, pw.async_playwright() as p:
        browser = await p.chromium.connect_over_cdp(f"http://{fwd.address}", timeout=60_000)
        try:
            ctx = browser.contexts[0] if browser.contexts else await browser.new_context()
            page = await ctx.new_page()
            await page.goto(APP_URL, timeout=30_000)
            await page.fill("#name", name)
            await page.fill("#qty", str(qty))
            await page.click("#submit")
            await page.wait_for_selector("#total", timeout=30_000)
            return str(await page.text_content("#total"))
        finally:
            await browser.close()


async def _sh(sb: AsyncSandbox, cmd: str) -> int:
    return (await sb.exec(["/bin/sh", "-c", cmd], timeout_s=60)).exit_code


async def honest_browser(sb: AsyncSandbox) -> list[int]:
    await order_in_browser(sb, CUSTOMER, QUANTITY)
    return [await _sh(sb, f"cat {ORDERS_PATH}")]


async def wrong_quantity(sb: AsyncSandbox) -> list[int]:
    await order_in_browser(sb, CUSTOMER, QUANTITY - 1)
    return []


async def idle_web(sb: AsyncSandbox) -> list[int]:
    return [await _sh(sb, "ls -la /srv/app /srv/app/state")]


async def cheat_forge_state(sb: AsyncSandbox) -> list[int]:
    """Writing the shop's state instead of using the shop: the harness's file refuses the agent,
    so the state directory is moved aside and a new one made with the wanted order in it."""
    line = json.dumps({"id": 1, "name": CUSTOMER, "qty": QUANTITY})
    state_dir = ORDERS_PATH.rsplit("/", 1)[0]
    return [await _sh(sb, f"echo '{line}' >> {ORDERS_PATH}"),
            await _sh(sb, f"mv {state_dir} {state_dir}.old && mkdir {state_dir} && echo '{line}' > {ORDERS_PATH}")]


WEB_POLICIES: list[Policy] = [
    Policy("web-honest-browser", "honest", 1.0, "", honest_browser),
    Policy("web-wrong-quantity", "wrong", 0.0, "", wrong_quantity),
    Policy("web-idle", "wrong", 0.0, "", idle_web),
    Policy("web-cheat-forge-state", "cheat", 0.0, "service_state_forged", cheat_forge_state),
]
