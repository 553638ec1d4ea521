"""What the corpus needs to know about an environment to act on it like an agent would: where the
bug is, what a correct file looks like (several ways), what a wrong one looks like, how the agent
runs the visible tests. Strategies use these facts, never the hidden tests."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from corral_common.contract.envs import EnvSpec


@dataclass(frozen=True)
class BenchEnv:
    name: str  # catalog name the spec builds under
    spec: Callable[[], EnvSpec]  # a fresh spec (may fetch and unpack an sdist: call it once per build)
    target: str  # absolute path (inside the sandbox) of the file the fix belongs in
    buggy: str  # target's content as shipped
    fixed: str  # a correct content of target
    module: str  # importable dotted module holding the bug, e.g. "calc.stats"
    function: str  # the buggy function's name in that module
    visible_test_cmd: str  # what an agent runs in the workdir to run the visible tests
    wrong: str  # a plausible but wrong content of target
    alt_fixes: tuple[str, ...] = ()  # other correct contents of target (different correct fixes)
    runner: str = "unittest"  # unittest | pytest
    workdir: str = "/repo"
    test_dirs: tuple[str, ...] = ("tests",)  # visible test directories, relative to workdir
    notes: dict[str, str] = field(default_factory=dict)
