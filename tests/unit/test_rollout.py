"""playbooks/rollout.yml, run for real by ansible-playbook on three local-connection hosts
whose host step fails at once (a bad rtfleet_host_kernel_flavour fails the role's argument
spec before any task): which hosts a batch took shows in the recap."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml
from conftest import REPO

HOSTS = ["n1", "n2", "n3"]


def _rollout(tmp_path, group_vars, host_vars=None):
    inv = tmp_path / "inventory"
    (inv / "group_vars").mkdir(parents=True)
    hosts = {
        name: {
            "ansible_connection": "local",
            "ansible_become": False,
            **(host_vars or {}).get(name, {}),
        }
        for name in HOSTS
    }
    (inv / "hosts.yml").write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
    (inv / "group_vars/all.yml").write_text(
        yaml.safe_dump({"rtfleet_host_kernel_flavour": "bogus", **group_vars})
    )
    playbook = os.path.join(os.path.dirname(sys.executable), "ansible-playbook")
    python = f"ansible_python_interpreter={sys.executable}"
    run = subprocess.run(
        [playbook, "-i", str(inv), str(REPO / "playbooks/rollout.yml"), "-e", python],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "ANSIBLE_NOCOLOR": "1",
            "RTFLEET_REPORT_DIR": str(tmp_path / "report"),
        },
        cwd=REPO,
        check=False,
        timeout=300,
    )
    recap = run.stdout.rpartition("PLAY RECAP")[2]
    started = [h for h in HOSTS if re.search(r"^%s\s+:" % h, recap, re.M)]
    return run, started


@pytest.mark.parametrize(
    ("group_vars", "first_batch"),
    [
        # group_vars reach the play keyword (they did not: all three went in one batch)
        ({"rtfleet_serial": 1}, ["n1"]),
        ({"rtfleet_serial": 2}, ["n1", "n2"]),
        # the default is a canary: one host first, and the first failure stops the rollout
        ({}, ["n1"]),
        ({"rtfleet_serial": ["67%", "100%"]}, ["n1", "n2"]),
    ],
)
def test_batches_come_from_the_inventory_and_a_failure_stops_the_rollout(
    tmp_path, group_vars, first_batch
):
    run, started = _rollout(tmp_path, group_vars)
    assert run.returncode != 0
    assert started == first_batch, run.stdout[-3000:]


def test_max_fail_percentage_comes_from_the_inventory(tmp_path):
    # Ansible itself ends the play when every host of a batch failed, so with one failing
    # host a batch the setting shows only in what the rollout announces.
    run, started = _rollout(tmp_path, {"rtfleet_serial": 2, "rtfleet_max_fail_percentage": 50})
    assert started == ["n1", "n2"]
    assert "batches of 2, stopping when more than 50 % of a batch fails" in run.stdout


@pytest.mark.parametrize(
    ("group_vars", "host_vars"),
    [
        ({"rtfleet_serial": 0}, None),
        ({"rtfleet_serial": "ten"}, None),
        ({"rtfleet_serial": []}, None),
        ({"rtfleet_max_fail_percentage": 150}, None),
        ({"rtfleet_serial": 1}, {"n3": {"rtfleet_serial": 2}}),
    ],
)
def test_bad_batch_settings_stop_before_any_host_changes(tmp_path, group_vars, host_vars):
    run, started = _rollout(tmp_path, group_vars, host_vars)
    assert run.returncode != 0 and started == []
    assert "rtfleet_serial must be one value for all targeted hosts" in run.stdout
