"""rtfleet_postcheck refuses bad thresholds and durations before anything runs.

The real role, through ansible-playbook on localhost: its first task checks every
duration and threshold (rtfleet.postcheck.check_settings) and stops with the variable's
name; the next task, which reads the host's records, must not have run.
"""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import run_local_playbook


def _run(tmp_path, **role_vars):
    play = [
        {
            "name": "Post-check",
            "hosts": "localhost",
            "gather_facts": False,
            "roles": [{"role": "rtfleet.fleet.rtfleet_postcheck", "vars": role_vars}],
        }
    ]
    playbook = tmp_path / "postcheck.yml"
    playbook.write_text(yaml.safe_dump(play))
    run = run_local_playbook(playbook, ANSIBLE_STDOUT_CALLBACK="json")
    tasks = [task for play in json.loads(run.stdout)["plays"] for task in play["tasks"]]
    return run, tasks


@pytest.mark.parametrize(
    ("role_vars", "message"),
    [
        (
            {"rtfleet_postcheck_oslat_duration": 0},
            "rtfleet_postcheck_oslat_duration is 0: give a whole number of seconds, at least 1",
        ),
        (
            {"rtfleet_postcheck_hwlatdetect_width_us": 1000000},
            "rtfleet_postcheck_hwlatdetect_width_us (1000000) must be below "
            "rtfleet_postcheck_hwlatdetect_window_us (1000000)",
        ),
        (
            {"rtfleet_postcheck_hwlatdetect_threshold_us": 50},
            "rtfleet_postcheck_hwlatdetect_threshold_us (50) must not be above "
            "rtfleet_postcheck_hwlatdetect_max_us (20)",
        ),
        (
            {"rtfleet_postcheck_oslat_priority": 120},
            "rtfleet_postcheck_oslat_priority is 120: give a SCHED_FIFO priority, 0 to 99",
        ),
        (
            {"rtfleet_postcheck_smoke_max_jitter": -1},
            "rtfleet_postcheck_smoke_max_jitter is -1",
        ),
    ],
)
def test_bad_settings_stop_the_role_before_it_reads_the_host(tmp_path, role_vars, message):
    run, tasks = _run(tmp_path, **role_vars)
    assert run.returncode != 0
    failed = [t for t in tasks if t["hosts"].get("localhost", {}).get("failed")]
    assert [t["task"]["name"] for t in failed] == [
        "rtfleet.fleet.rtfleet_postcheck : Refuse bad thresholds and durations before anything runs"
    ]
    assert message in failed[0]["hosts"]["localhost"]["msg"]
    names = [t["task"]["name"] for t in tasks]
    assert not [n for n in names if n.startswith("rtfleet.fleet.rtfleet_postcheck : Read ")], names
