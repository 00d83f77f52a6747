"""The post-check's cyclictest runner (roles/rtfleet_postcheck/templates/run-cyclictest.sh.j2).

Rendered with the role's variables and run for real on this machine: cyclictest must write
a JSON document that rtfleet.postcheck parses, for the CPUs asked, and the background load
must be gone when the script ends, whether cyclictest succeeded or not. Needs root and
rt-tests (`make deps` installs it).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from pathlib import Path

import jinja2
import pytest

from rtfleet.postcheck import parse_cyclictest

TEMPLATE = Path(__file__).parents[2] / "roles/rtfleet_postcheck/templates/run-cyclictest.sh.j2"

pytestmark = pytest.mark.skipif(
    shutil.which("cyclictest") is None or os.geteuid() != 0,
    reason="needs root and cyclictest (make deps installs rt-tests)",
)


def _render(tmp_path, load, duration=2, cpus="0", priority=95):
    script = tmp_path / "run-cyclictest"
    text = jinja2.Template(TEMPLATE.read_text(), keep_trailing_newline=True).render(
        ansible_managed="test",
        __rtfleet_postcheck_load=load,
        __rtfleet_postcheck_housekeeping="0",
        __rtfleet_postcheck_cpus=cpus,
        __rtfleet_postcheck_slice="rtfleet_check.slice",
        rtfleet_postcheck_priority=priority,
        rtfleet_postcheck_interval_us=1000,
        rtfleet_postcheck_duration=duration,
        rtfleet_postcheck_histogram_us=1000,
    )
    script.write_text(text)
    script.chmod(0o755)
    return script


def _marker():
    """A load command no other process on the machine runs (pgrep -f sees every process:
    a fixed one matched a concurrent run of this test from another checkout)."""
    return "sleep 3%03d.%06d" % (os.getpid() % 1000, random.randrange(10**6))


def _load_alive(marker):
    return subprocess.run(["pgrep", "-f", marker], capture_output=True, check=False).returncode == 0


def test_runner_measures_the_cpus_and_stops_its_load(tmp_path):
    marker = _marker()
    out = tmp_path / "ct.json"
    run = subprocess.run(
        [str(_render(tmp_path, marker)), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    parsed = parse_cyclictest(out.read_text())
    assert [row["cpu"] for row in parsed["cpus"]] == [0]
    assert parsed["summary"]["cycles"] > 0
    assert not _load_alive(marker), "the background load outlived the runner"


def test_runner_stops_its_load_when_cyclictest_fails(tmp_path):
    marker = _marker()
    # Priority 100 is out of range: cyclictest refuses to start.
    script = _render(tmp_path, marker, priority=100)
    run = subprocess.run(
        [str(script), str(tmp_path / "ct.json")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode != 0
    assert not _load_alive(marker), "the background load outlived a failed run"
