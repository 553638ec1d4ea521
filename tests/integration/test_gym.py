"""corral_sdk.integrations.gym against the session stack: the Gymnasium env (gymnasium.make and the env checker)
and the asyncio one. An episode is one rollout of the demo environment: reset gives the task,
step runs a command and observes its output with reward 0, the submit action (or the step limit)
ends it with the grade's reward."""
from __future__ import annotations

import asyncio

import gymnasium
import pytest
import pytest_asyncio
from gymnasium.utils.env_checker import check_env

from corral_common.contract.errors import InvalidRequest
from corral_sdk.demo_env import demo_spec
from corral_sdk.demo_policies import FIX_BY_PYTHON
from corral_sdk.integrations.gym import ENV_ID, REPLACEMENT, AsyncCorralEnv, CorralEnv

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]
ENV = "calc-gym"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def env(client):
    res = await client.envs.build(demo_spec(ENV), job="gym-tests")
    assert res.accepted, res.report.summary()
    yield res.env
    await client.envs.delete(res.env.name, res.env.version)


def _sync_episodes(url: str) -> dict:
    """Two episodes through gymnasium.make (its passive checker validates spaces on the way)."""
    e = gymnasium.make(ENV_ID, env=ENV, nats_url=url, max_steps=3, job="gym-sync")
    out: dict = {}
    try:
        obs, info = e.reset(seed=1)
        out["reset"] = (obs, info)
        out["look"] = e.step("cat calc/stats.py")
        out["fix"] = e.step(FIX_BY_PYTHON)
        out["submit"] = e.step("submit")
        try:
            e.step("ls")
        except InvalidRequest as err:
            out["after_end"] = err.message
        obs2, info2 = e.reset()
        out["reset2"] = (obs2, info2)
        out["fail"] = e.step("echo oops >&2; exit 3")
        out["unicode"] = e.step("printf 'h\\303\\251llo'")
        out["last"] = e.step("true")  # the third step: the limit
        out["space"] = e.observation_space
    finally:
        e.close()
    return out


async def test_sync_gymnasium_episodes(stack, client, env):
    out = await asyncio.to_thread(_sync_episodes, stack.url)
    obs, info = out["reset"]
    assert "median" in obs["task"] and obs["stdout"] == "" and obs["exit_code"] == 0 and info["sandbox_id"].startswith("sb-")
    assert info["task"].env == ENV and info["task"].workdir == "/repo"
    obs, reward, term, trunc, info = out["look"]
    assert "def median" in obs["stdout"] and reward == 0.0 and not term and not trunc and info["exit_code"] == 0
    obs, reward, term, trunc, info = out["submit"]
    assert (reward, term, trunc) == (1.0, True, False) and info["grade"].passed and not info["grade"].alerts
    assert "reset() first" in out["after_end"]
    # a new episode is a fresh rollout: another sandbox, the bug back
    obs2, info2 = out["reset2"]
    assert info2["sandbox_id"] != out["reset"][1]["sandbox_id"]
    obs, reward, term, trunc, info = out["fail"]
    assert obs["exit_code"] == 3 and obs["stderr"] == "oops\n" and (reward, term, trunc) == (0.0, False, False)
    obs, *_ , info = out["unicode"]
    assert obs["stdout"] == f"h{REPLACEMENT}llo" and info["stdout"] == "héllo" and out["space"].contains(obs)
    obs, reward, term, trunc, info = out["last"]
    assert (reward, term, trunc) == (0.0, False, True) and not info["grade"].passed  # graded at the limit: unfixed
    assert await client.list(job="gym-sync") == []


async def test_gymnasium_env_checker(stack, client, env):
    def check() -> None:
        e = CorralEnv(ENV, nats_url=stack.url, max_steps=2, job="gym-check")
        try:
            check_env(e, skip_render_check=True)
        finally:
            e.close()

    await asyncio.to_thread(check)
    assert await client.list(job="gym-check") == []


async def test_async_episodes(client, env):
    envs = [AsyncCorralEnv(client, ENV, job="gym-async", max_steps=10) for _ in range(3)]

    async def honest(e):
        await e.reset()
        await e.step(FIX_BY_PYTHON)
        return await e.step("submit")

    async def cheat(e):
        await e.reset()
        await e.step("cat /repo/.mgmt/answers.json")
        await e.step(FIX_BY_PYTHON)
        return await e.step("submit")

    async def abandon(e):
        obs, info = await e.reset()
        await e.step("ls")
        await e.close()  # unfinished: destroyed ungraded
        return info["sandbox_id"]

    (_, r1, t1, _, i1), (_, r2, t2, _, i2), gone = await asyncio.gather(honest(envs[0]), cheat(envs[1]), abandon(envs[2]))
    assert r1 == 1.0 and t1 and i1["grade"].passed
    assert r2 == 0.0 and t2 and i2["grade"].passed and "canary_read" in {a.rule for a in i2["grade"].alerts}
    assert gone.startswith("sb-") and await client.list(job="gym-async") == []
    with pytest.raises(InvalidRequest):
        await envs[0].step("ls")
