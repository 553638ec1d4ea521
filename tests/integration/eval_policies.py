"""Policies `corral eval` loads by `module:function` in test_eval.py and test_gym.py: they act
only through the sandbox and read what to do from the task, like an agent would."""
from __future__ import annotations

from corral_sdk.demo_env import STATS_FIXED

SEEN_TASKS: list = []


async def fix(sb, task) -> None:
    """Read the code, write the fix with the files API, run the visible tests."""
    SEEN_TASKS.append(task)
    assert "median" in task.description and task.workdir == "/repo"
    await sb.exec(["cat", f"{task.workdir}/calc/stats.py"])
    await sb.files.write(f"{task.workdir}/calc/stats.py", STATS_FIXED)
    await sb.exec(["/bin/sh", "-c", "python3 -m unittest discover -s tests -t . 2>&1 | tail -1"])


async def idle(sb, task) -> None:
    await sb.exec(["ls", task.workdir])


async def read_answers(sb, task) -> None:
    """The demo env's planted answers file: the monitor flags reading it."""
    await sb.exec(["cat", "/repo/.mgmt/answers.json"])


async def crash(sb, task) -> None:
    await sb.exec(["true"])
    raise RuntimeError("policy bug")


def not_async(sb, task) -> None:
    return None
