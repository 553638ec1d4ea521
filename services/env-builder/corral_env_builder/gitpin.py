"""Pinning a repository so its history cannot leak the future.

Agents have found upstream fixes with `git log --all`, in tags, remote-tracking branches, stashes,
reflogs and unreachable objects. Pinning keeps exactly one branch at the pinned commit and removes
everything else, then checks the result from the outside in (verify's `git_pinned`)."""
from __future__ import annotations

import shlex

PIN = r"""
set -e
cd {path}
git rev-parse --git-dir >/dev/null
target=$(git rev-parse --verify {commit}^{{commit}})
branch=$(git symbolic-ref -q --short HEAD || echo main)
git checkout -q --detach "$target"
for r in $(git remote); do git remote remove "$r"; done
git for-each-ref --format='%(refname)' | while read -r ref; do git update-ref -d "$ref"; done
git stash clear 2>/dev/null || true
git update-ref "refs/heads/$branch" "$target"
git symbolic-ref HEAD "refs/heads/$branch"
git reset -q --hard "$target"
rm -f .git/FETCH_HEAD .git/ORIG_HEAD .git/MERGE_HEAD .git/CHERRY_PICK_HEAD .git/REVERT_HEAD .git/packed-refs.lock
rm -rf .git/logs .git/refs/original .git/rebase-merge .git/rebase-apply
rm -f .git/objects/pack/*.keep .git/objects/info/alternates
git reflog expire --expire=now --expire-unreachable=now --all
git -c gc.reflogExpire=now -c gc.reflogExpireUnreachable=now -c gc.pruneExpire=now gc -q --prune=now
git prune --expire=now
echo "pinned $branch at $target"
"""

CHECK = r"""
cd {path} || exit 3
fail() {{ echo "LEAK: $*"; bad=1; }}
bad=0
head=$(git rev-parse HEAD)
refs=$(git for-each-ref --format='%(refname)')
[ "$(echo "$refs" | grep -c .)" -le 1 ] || fail "refs besides the pinned branch: $(echo $refs)"
[ -z "$(git tag -l)" ] || fail "tags: $(git tag -l | tr '\n' ' ')"
[ -z "$(git remote)" ] || fail "remotes: $(git remote | tr '\n' ' ')"
[ -z "$(git stash list 2>/dev/null)" ] || fail "stashes"
all=$(git rev-list --all --reflog 2>/dev/null | sort)
reach=$(git rev-list HEAD | sort)
[ "$all" = "$reach" ] || fail "commits not reachable from HEAD: $(comm -23 <(echo "$all") <(echo "$reach") 2>/dev/null | head -5 | tr '\n' ' ')"
objs=$(git cat-file --batch-all-objects --batch-check='%(objectname)' | sort)
reachobj=$(git rev-list --objects HEAD | cut -d' ' -f1 | sort)
extra=$(comm -23 <(echo "$objs") <(echo "$reachobj") | head -5)
[ -z "$extra" ] || fail "objects not reachable from HEAD: $(echo $extra)"
[ ! -d .git/logs ] || [ -z "$(find .git/logs -type f -size +0c)" ] || fail "reflogs"
echo "head $head, $(echo "$reach" | grep -c .) commits"
exit $bad
"""


def pin_script(path: str, commit: str) -> str:
    return PIN.format(path=shlex.quote(path), commit=shlex.quote(commit))


def check_script(path: str) -> str:
    """Run with bash (process substitution); exits non-zero and prints `LEAK:` lines on a leak."""
    return CHECK.format(path=shlex.quote(path))
