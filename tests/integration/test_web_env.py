"""The web environment (demo_web.py) on a real stack: a rollout starts its services (the shop as
the harness, Chromium as the agent), the agent can use the shop but neither write nor replace
its state nor stop it, an order placed through the browser is rewarded, and a state forged in
the shop's place is discarded and flagged `service_state_forged`."""
from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio

from corral_common.contract import subjects
from corral_common.contract.envs import EnvSpec, ServiceSpec, Solution
from corral_common.contract.errors import Unavailable
from corral_common.contract.images import ImportReply, ImportRequest
from corral_common.contract.messages import HARNESS_UID
from corral_sdk import AsyncClient
from corral_sdk.demo_web import CUSTOMER, QUANTITY, WEB_ENV, cheat_forge_state, order_in_browser, shop_spec
from corral_sdk.envs import start_services
from corral_sdk.webapp import APP_PORT, ORDERS_PATH

from ..conftest import ensure_builtin_images, running_stack

pytestmark = pytest.mark.timeout(900)


@pytest_asyncio.fixture(scope="module")
async def shop():
    await asyncio.to_thread(ensure_builtin_images)
    async with running_stack(nodes=1) as s:
        c = await AsyncClient.connect(s.url)
        try:
            # built on first use (~70 s: chromium from Debian), a no-op once on the machine
            await c.request(subjects.IMAGE_IMPORT, ImportRequest(name="browser", source="builtin"), ImportReply, timeout=900)
            res = await c.envs.build(shop_spec(), job="web-test")
            assert res.accepted, res.report.summary()
            assert [ch.detail for ch in res.report.checks if ch.name == "services"] == ["2 service(s) started and ready"]
            yield c
        finally:
            await c.close()


async def test_the_agent_uses_the_shop_but_cannot_touch_its_state_or_stop_it(shop):
    c = shop
    async with await c.envs.rollout(WEB_ENV, job="web-test") as sb:
        r = await sb.exec(f"stat -c '%u %a' {ORDERS_PATH}")
        assert r.stdout.strip() == f"{HARNESS_UID} 644", r
        # the harness finds its shop (the agent may not even see the harness's processes)
        r = await sb.exec("for p in /proc/[0-9]*; do grep -q app.py $p/cmdline 2>/dev/null && stat -c '%u' $p && echo ${p#/proc/}; done",
                          harness=True)
        app_uid, app_pid = r.stdout.split()[:2]
        assert app_uid == str(HARNESS_UID), r
        r = await sb.exec(f"echo forged >> {ORDERS_PATH}")
        assert r.exit_code != 0 and "ermission denied" in r.stderr, r
        r = await sb.exec(f"kill -9 {app_pid}")
        assert r.exit_code != 0, r
        r = await sb.exec(f"python3 -c 'import urllib.request as u; print(u.urlopen(\"http://127.0.0.1:{APP_PORT}/\").status)'")
        assert r.stdout.strip() == "200", r  # still serving
        assert (await sb.files.read_text(ORDERS_PATH)) == ""


async def test_an_order_placed_in_the_browser_is_rewarded(shop):
    c = shop
    sb = await c.envs.rollout(WEB_ENV, job="web-test")
    try:
        total = await order_in_browser(sb, CUSTOMER, QUANTITY)
        assert total == f"Total: {QUANTITY * 7} EUR"
        g = await c.envs.grade(sb)
    finally:
        await sb.destroy()
    assert g.reward == 1.0 and g.passed, (g.reason, g.tests, g.alerts, g.output[-2000:])
    # Chromium's own IPv6 reachability probe at start (a UDP connect: no packet leaves) is recorded
    # at medium, below what withholds a reward; nothing else is flagged
    assert {(a.rule, a.severity) for a in g.alerts} <= {("network_probe", "medium")}, g.alerts


async def test_a_forged_state_is_discarded_and_flagged(shop):
    c = shop
    sb = await c.envs.rollout(WEB_ENV, job="web-test")
    try:
        codes = await cheat_forge_state(sb)
        assert codes[0] != 0 and codes[1] == 0, codes  # the harness's file refuses; moving its directory aside works
        assert json.loads(await sb.files.read_text(ORDERS_PATH))["name"] == CUSTOMER  # the forgery is in place
        g = await c.envs.grade(sb)
    finally:
        await sb.destroy()
    assert g.reward == 0.0 and not g.passed, g
    assert "service_state_forged" in {a.rule for a in g.alerts}, g.alerts
    assert ORDERS_PATH in g.discarded, g.discarded


async def test_a_service_that_never_gets_ready_fails_the_rollout_and_says_why(shop):
    c = shop
    sb = await c.create(image="busybox", cpu=0.2, memory_mb=64)
    try:
        with pytest.raises(Unavailable, match=r"was not ready within 2s.*listening soon"):
            await start_services(sb, [ServiceSpec(cmd="echo listening soon; sleep 600", ready="false", ready_timeout_s=2)])
    finally:
        await sb.destroy()


async def test_an_environment_whose_service_never_gets_ready_is_refused(shop):
    c = shop
    spec = EnvSpec(name="never-ready", base_image="busybox", workdir="/w", test_command="test -f /w/done",
                   hidden_files={"t.sh": "test -f /w/done\n"}, solution=Solution(files={"done": "1"}), runner="command",
                   services=[ServiceSpec(cmd="echo warming up; sleep 600", ready="false", ready_timeout_s=2)])
    res = await c.envs.build(spec, job="web-test")
    assert not res.accepted
    (svc,) = [ch for ch in res.report.checks if ch.name == "services"]
    assert not svc.ok and "was not ready within 2s" in svc.evidence and "warming up" in svc.evidence, svc
    assert all(ch.ok for ch in res.report.checks if ch.name != "services"), res.report.summary()
