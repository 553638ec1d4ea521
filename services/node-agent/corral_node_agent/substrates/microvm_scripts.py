"""The guest-side shell scripts of a microvm's execs and sessions: what the guest agent
(guest/agent.sh) runs, in a cgroup of its own, to put a command in the sandbox's side of the
guest (init/corral-guest.c)."""
from __future__ import annotations

import shlex

#: runs a command in the guest's sandbox: its PID and mount namespaces (held by the process whose
#: pid init.sh wrote to HOLDER), the image's root, no capability, seccomp (init/corral-guest.c)
HOLDER = "/run/corral-holder.pid"


def _enter(harness: bool) -> list[str]:
    return ["/bin/corral-guest", "enter", *(["--harness"] if harness else []), HOLDER, "--"]


def session_script(shell: str, env: dict[str, str], cwd: str, harness: bool = False) -> str:
    """The guest-side script that becomes a session's shell (the agent has put it in a cgroup of
    its own): a clean environment, the sandbox's side of the guest, its workdir, then `shell`
    reading commands from the agent."""
    return "exec " + shlex.join(["/bin/env", "-i", *(f"{k}={v}" for k, v in env.items()), *_enter(harness), shell, "-c",
                                 'cd -- "$1" 2>/dev/null; exec "$0"', shell, cwd]) + "\n"


def exec_script(argv: list[str], env: dict[str, str], cwd: str, harness: bool = False) -> str:
    """The guest-side script of one exec (the agent has put it in a cgroup of its own, under the
    sandbox's, which holds pids_max): a clean environment, the sandbox's side of the guest, its
    cwd, then the command; a missing cwd or command gets the container substrate's message and code."""
    inner = ('cd -- "$1" 2>/dev/null || { printf "corral: cannot change directory to %s: No such file or directory\\n" "$1" >&2; '
             'exit 126; }; shift; command -v -- "$1" >/dev/null 2>&1 || '
             '{ printf "corral: cannot run %s: No such file or directory\\n" "$1" >&2; exit 127; }; exec "$@"')
    return "exec " + shlex.join(["/bin/env", "-i", *(f"{k}={v}" for k, v in env.items()), *_enter(harness),
                                 "/.corral/busybox", "sh", "-c", inner, "corral-exec", cwd, *argv]) + "\n"
