"""`shminfer bench ipc` runs end to end on real processes (a short run; its figures are
not judged here: speed targets are the bench's own PASS/FAIL lines, never a test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shminfer.bench import ROUNDS, iceoryx2_available

pytestmark = pytest.mark.skipif(
    not {0, 1} <= os.sched_getaffinity(0), reason="the bench pins to CPUs 0 and 1"
)


def _bench(*variants):
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "shminfer.cli", "bench", "ipc", "--requests", "400"),
            *("--idle-samples", "1", "--format", "json", "--variants", ",".join(variants)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_variants_that_wait_side_by_side_are_measured_interleaved():
    names = ["shminfer", "pipe_pickle", "sleep_poll"]
    if iceoryx2_available():  # the busy-polling server is paused between its rounds
        names.append("iceoryx2")
    report = _bench(*names)
    together = report["interleaved"]
    assert together["variants"] == [n for n in names if n != "sleep_poll"]
    assert len(together["rounds_p50_us"]) == ROUNDS
    for by_round in together["rounds_p50_us"]:
        assert sorted(by_round) == sorted(together["variants"])
        assert all(p50 > 0 for p50 in by_round.values())
    assert list(report["variants"]) == names  # sleep_poll alone, after the others
    for name, result in report["variants"].items():
        expected = 400 if name != "sleep_poll" else 200
        assert result["requests"] == expected, name
        assert 0 < result["p50_us"] <= result["p99_us"] <= result["max_us"]
    assert report["variants"]["shminfer"]["rps_4_in_flight"] > 0
    targets = {name for name, _, _ in report["targets"]}
    assert "pipe_pickle p50 / shminfer p50 >= 20" in targets
    assert ("shminfer p50 / iceoryx2 p50 <= 0.5" in targets) == iceoryx2_available()


def test_a_variant_alone_is_not_interleaved():
    report = _bench("shminfer")
    assert "interleaved" not in report
    assert report["variants"]["shminfer"]["requests"] == 400
