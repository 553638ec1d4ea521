"""The guest guard's report lines (`E 0 kind pid denied who -comm -path`, init/corral-guest.c) as
the node's end of the channel reads them: each kind handed on whole, anything else dropped
without breaking the channel (the line comes from inside a guest)."""
from __future__ import annotations

import base64

from corral_node_agent.substrates.base import GuardedOpen
from corral_node_agent.substrates.microvm_channel import GuestChannel


def _b64(text: str) -> str:
    return "-" + base64.b64encode(text.encode()).decode()


def _read(*lines: str) -> list[GuardedOpen]:
    chan = GuestChannel("/nonexistent")
    got: list[GuardedOpen] = []
    chan.on_guard = got.append
    for line in lines:
        chan._guarded(line.split())
    return got


def test_every_kind_of_report_is_handed_on_whole():
    got = _read(f"E 0 p 42 1 x7 {_b64('cat')} {_b64('/secret/answer.txt')}",
                f"E 0 c 43 0 read {_b64('head')} {_b64('/answers.json')}",
                f"E 0 write 44 0 s1 {_b64('sh')} {_b64('/tmp/f x')}",
                "E 0 dropped 0 0 - - " + _b64("581"))
    assert got == [GuardedOpen(kind="p", pid=42, denied=True, who="x7", comm="cat", path="/secret/answer.txt"),
                   GuardedOpen(kind="c", pid=43, denied=False, who="read", comm="head", path="/answers.json"),
                   GuardedOpen(kind="write", pid=44, denied=False, who="s1", comm="sh", path="/tmp/f x"),
                   GuardedOpen(kind="dropped", pid=0, denied=False, who="-", comm="", path="581")]


def test_a_malformed_or_unknown_report_is_dropped():
    assert _read("E 0 p notapid 1 x7 - -", "E 0 mount 1 0 x1 - -", "E 0 p 1 1 x1 -", f"E 0 p 1 1 x1 - -{'!' * 5}") == []


def test_reports_before_anyone_takes_them_are_held_and_handed_on_in_order():
    """An adopted guest's guard reports what it saw while no node-agent ran as soon as the new
    channel connects, before the node's audit wiring takes its reports: none may be lost."""
    chan = GuestChannel("/nonexistent")
    lines = [f"E 0 p {pid} 1 x7 {_b64('cat')} {_b64('/secret/answer.txt')}" for pid in (10, 11)]
    for line in lines:
        chan._guarded(line.split())
    got: list[GuardedOpen] = []
    chan.on_guard = got.append
    chan._guarded(f"E 0 c 12 0 x8 {_b64('cat')} {_b64('/canary')}".split())
    assert [(g.kind, g.pid) for g in got] == [("p", 10), ("p", 11), ("c", 12)]
    assert chan.held == []
