"""An exec result always fits the message that carries it: output that JSON spells six bytes per
byte (control characters) or that max_output_bytes lets past the bus's max_payload is cut, and
the cut is flagged."""
from __future__ import annotations

import pytest

from corral_common.contract.messages import ExecResult, encoder
from corral_node_agent.handlers.exec import fit_to_bus


@pytest.mark.parametrize("stdout,stderr", [
    ("\0" * 3_000_000, ""),                  # 6 JSON bytes per character
    ("a" * 5_000_000, "b" * 5_000_000),      # both streams large
    ("é" * 1_000_000, "\x01" * 10),          # multi-byte UTF-8
    ("", "\x7f\x1b" * 900_000),
])
def test_results_are_cut_to_fit_and_flagged(stdout, stderr):
    limit = 1 << 20
    r = fit_to_bus(ExecResult(exit_code=3, stdout=stdout, stderr=stderr, duration_ms=1.5), limit)
    assert len(encoder.encode(r)) <= limit
    assert r.truncated and r.exit_code == 3 and r.duration_ms == 1.5
    assert stdout.startswith(r.stdout) and stderr.startswith(r.stderr)  # the head is kept
    assert len(encoder.encode(r)) > limit // 2  # and not much more is thrown away than needed


def test_a_short_stream_beside_a_flood_survives_whole():
    r = fit_to_bus(ExecResult(exit_code=1, stdout="\0" * 3_000_000, stderr="Traceback: boom\n"), 1 << 20)
    assert r.stderr == "Traceback: boom\n" and r.truncated and len(encoder.encode(r)) <= 1 << 20


def test_a_result_that_fits_is_left_alone():
    r = ExecResult(exit_code=0, stdout="x" * 1000, stderr="\0" * 100)
    assert fit_to_bus(r, 1 << 20) is r
