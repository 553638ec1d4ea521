"""Egress allowlist entries: what parses, what is refused, what a resolved list allows."""
from __future__ import annotations

import pytest

from corral_common import egress
from corral_common.contract.errors import InvalidRequest


@pytest.mark.parametrize("entry,host,port", [
    ("10.1.2.3", "10.1.2.3/32", None), ("10.1.2.3:443", "10.1.2.3/32", 443), ("10.0.0.0/8", "10.0.0.0/8", None),
    ("10.1.2.3/16:80", "10.1.0.0/16", 80), ("pypi.org", "pypi.org", None), ("Files.PythonHosted.org:443", "files.pythonhosted.org", 443),
])
def test_entries_parse(entry, host, port):
    assert egress.parse(entry) == egress.Rule(host, port)


@pytest.mark.parametrize("entry", ["127.0.0.1", "127.0.0.0/8", "0.0.0.0/0", "169.254.169.254", "224.0.0.1", "10.0.0.0/33",
                                   "10.1.2.3:0", "10.1.2.3:70000", "host:http", "bad_host!", "-lead.example", "::1",
                                   "1.2.3", "a..b"])
def test_bad_or_forbidden_entries_are_refused(entry):
    with pytest.raises(InvalidRequest):
        egress.parse(entry)


def test_network_and_entries_go_together():
    with pytest.raises(InvalidRequest):
        egress.check("allowlist", [])
    with pytest.raises(InvalidRequest):
        egress.check("none", ["10.0.0.1"])
    assert egress.check("none", []) == []
    assert egress.check("allowlist", ["10.0.0.1:22"]) == [egress.Rule("10.0.0.1/32", 22)]


def test_allows():
    rules = [("10.1.0.0/16", None), ("10.2.0.1/32", 443)]
    assert egress.allows(rules, "10.1.200.7", 9999)
    assert egress.allows(rules, "10.2.0.1", 443) and not egress.allows(rules, "10.2.0.1", 80)
    assert not egress.allows(rules, "10.3.0.1", 443) and not egress.allows(rules, "not-an-ip", 443)
