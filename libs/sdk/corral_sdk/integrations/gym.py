"""A Gymnasium interface to corral environments, for RL code written against `gymnasium.Env`.

An episode is one rollout: `reset()` takes a fresh sandbox of the environment and returns the task
(its description) as the observation; `step(command)` runs the command with `sh -c` in the
workdir and observes its stdout, stderr and exit code, with reward 0. The episode ends when the
agent sends the submit action (`terminated`) or reaches `max_steps` (`truncated`): then, and only
then, the rollout is graded (hidden tests and the monitor's alerts) and the grade's reward is the
step's reward; `info["grade"]` holds the whole EnvGradeResult. Why grade at the end only: the
hidden tests are the reward, and running them mid-episode would leak them to the agent.

`AsyncCorralEnv` is the asyncio form (many episodes in one event loop); `CorralEnv` subclasses
`gymnasium.Env` and runs the async one on the SDK's background loop. Observations are a Dict of
Text spaces (task, stdout, stderr) and the exit code; text is cut to its last `max_text`
characters and characters outside the printable-ASCII charset become U+FFFD (Gymnasium's Text
space needs a finite charset; `info["stdout"]`/`info["stderr"]` carry the raw output).

    env = gymnasium.make("corral/Rollout-v0", env="calc-median", nats_url="nats://127.0.0.1:4222")
    obs, info = env.reset()
    obs, reward, terminated, truncated, info = env.step("cat calc/stats.py")
    ...
    obs, reward, terminated, truncated, info = env.step("submit")   # reward: the grade
"""
from __future__ import annotations

import string
from typing import Any

from corral_common import extras
from corral_common.contract.envs import EnvGradeResult, EnvRecord
from corral_common.contract.errors import CorralError, InvalidRequest

from ..client import AsyncClient, AsyncSandbox
from ..eval import Task, task_for

gymnasium = extras.require("gymnasium", "rl", "corral_sdk.integrations.gym")
import numpy as np  # noqa: E402  (gymnasium's own dependency: present once the require above passed)
from gymnasium import Env, spaces  # noqa: E402  (after the clear error when gymnasium is missing)

REPLACEMENT = "\ufffd"
CHARSET = frozenset(string.printable + REPLACEMENT)
SUBMIT = "submit"
ENV_ID = "corral/Rollout-v0"


def to_text(s: str, max_length: int) -> str:
    """`s` inside the Text space: unknown characters replaced, only the last max_length kept."""
    out = "".join(c if c in CHARSET else REPLACEMENT for c in s)
    return out[-max_length:] if len(out) > max_length else out


def observation_space(max_text: int) -> spaces.Dict:
    return spaces.Dict({
        "task": spaces.Text(max_text, min_length=0, charset=CHARSET),
        "stdout": spaces.Text(max_text, min_length=0, charset=CHARSET),
        "stderr": spaces.Text(max_text, min_length=0, charset=CHARSET),
        "exit_code": spaces.Box(low=-(2**31), high=2**31 - 1, shape=(), dtype=np.int64),
    })


def action_space(max_command: int) -> spaces.Text:
    return spaces.Text(max_command, min_length=1, charset=CHARSET)


class AsyncCorralEnv:
    """The episode logic, in asyncio: `await env.reset()`, `await env.step(cmd)`, `await env.close()`."""

    def __init__(self, client: AsyncClient, env: str, version: str = "", *, job: str = "gym", max_steps: int = 50,
                 submit_action: str = SUBMIT, exec_timeout_s: float = 60.0, max_text: int = 16384, fail_on: str = "high"):
        if max_steps < 1:
            raise InvalidRequest("max_steps must be at least 1")
        self.client, self.env, self.version, self.job = client, env, version, job
        self.max_steps, self.submit_action, self.exec_timeout_s = max_steps, submit_action, exec_timeout_s
        self.max_text, self.fail_on = max_text, fail_on
        self.observation_space = observation_space(max_text)
        self.action_space = action_space(65536)
        self.record: EnvRecord | None = None
        self.sandbox: AsyncSandbox | None = None
        self.task: Task | None = None
        self.steps = 0
        self.episodes = 0

    def _obs(self, stdout: str = "", stderr: str = "", exit_code: int = 0) -> dict[str, Any]:
        assert self.task is not None
        return {"task": to_text(self.task.description, self.max_text), "stdout": to_text(stdout, self.max_text),
                "stderr": to_text(stderr, self.max_text), "exit_code": np.asarray(exit_code, dtype=np.int64)}

    async def reset(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """A fresh rollout; a sandbox left from an unfinished episode is destroyed ungraded."""
        await self._discard()
        if self.record is None:
            self.record = await self.client.envs.get(self.env, self.version)
        self.sandbox = await self.client.envs.rollout_of(self.record, job=self.job,
                                                         labels={"gym_episode": str(self.episodes)})
        self.task = task_for(self.record, self.episodes)
        self.episodes += 1
        self.steps = 0
        return self._obs(), {"sandbox_id": self.sandbox.id, "task": self.task}

    async def step(self, action: str) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        if self.sandbox is None:
            raise InvalidRequest("no episode running: call reset() first (after the episode ended, too)")
        if not isinstance(action, str) or not action.strip():
            raise InvalidRequest("an action is a non-empty shell command (or the submit action)")
        if action.strip() == self.submit_action:
            grade = await self._grade()
            return self._obs(), grade.reward, True, False, {"grade": grade, "steps": self.steps}
        assert self.task is not None
        r = await self.sandbox.exec(["/bin/sh", "-c", action], cwd=self.task.workdir, timeout_s=self.exec_timeout_s)
        self.steps += 1
        obs = self._obs(r.stdout, r.stderr, r.exit_code)
        info: dict[str, Any] = {"stdout": r.stdout, "stderr": r.stderr, "exit_code": r.exit_code, "timed_out": r.timed_out,
                                "steps": self.steps}
        if self.steps >= self.max_steps:
            grade = await self._grade()
            info["grade"] = grade
            return obs, grade.reward, False, True, info
        return obs, 0.0, False, False, info

    async def _grade(self) -> EnvGradeResult:
        sb, self.sandbox = self.sandbox, None
        assert sb is not None
        try:
            return await self.client.envs.grade(sb, destroy=True, fail_on=self.fail_on)
        except CorralError:
            await _destroy(sb)
            raise

    async def _discard(self) -> None:
        sb, self.sandbox = self.sandbox, None
        if sb is not None:
            await _destroy(sb)

    async def close(self) -> None:
        await self._discard()


async def _destroy(sb: AsyncSandbox) -> None:
    try:
        await sb.destroy()
    except CorralError:
        pass  # gone already (ttl, or the grader destroyed it): nothing left to free


class CorralEnv(Env[dict[str, Any], str]):
    """`gymnasium.Env` over AsyncCorralEnv, run on the SDK's background event loop. Give `client`
    (an AsyncClient on that loop) or `nats_url` (default $CORRAL_NATS_URL): then the env opens its
    own connection and closes it in `close()`."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, env: str, version: str = "", *, nats_url: str | None = None, client: AsyncClient | None = None,
                 **kw: Any):
        from ..sync import _run

        self._run = _run
        self._own = client is None
        self._client = client or _run(AsyncClient.connect(nats_url))
        self._env = AsyncCorralEnv(self._client, env, version, **kw)
        self.observation_space = self._env.observation_space
        self.action_space = self._env.action_space

    @property
    def task(self) -> Task | None:
        return self._env.task

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        super().reset(seed=seed)
        return self._run(self._env.reset())

    def step(self, action: str) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        return self._run(self._env.step(action))

    def close(self) -> None:
        if self._client is None:
            return
        try:
            self._run(self._env.close())
        finally:
            if self._own:
                self._run(self._client.close())
            self._client = None  # type: ignore[assignment]


gymnasium.register(id=ENV_ID, entry_point="corral_sdk.integrations.gym:CorralEnv", disable_env_checker=False)
