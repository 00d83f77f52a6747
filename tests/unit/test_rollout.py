"""playbooks/rollout.yml, run for real by ansible-playbook on local-connection hosts.

Two ways to see the batches without touching this machine: hosts whose host step fails at
once (a bad rtfleet_host_kernel_flavour fails the role's argument spec before any task), and
a run with a tag no task has, where each batch of the rolling play only gathers facts (its
own "PLAY [...]" header in the output) and a host that cannot be reached counts as failed."""

from __future__ import annotations

import json
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
    rolling = run.stdout.partition("PLAY [Roll out rtfleet, a batch at a time]")[2]
    rolling = rolling.partition("PLAY RECAP")[0]
    started = [
        h for h in HOSTS if re.search(r"^(ok|fatal|failed|changed): \[%s\]" % h, rolling, re.M)
    ]
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


RACK = ["h1", "h2", "h3", "h4"]


def _rack_batches(tmp_path, group_vars, limit=None, unreachable=(), failed=()):
    """Four hosts in group rack1 of inference_nodes, the settings in inference_nodes'
    group_vars (as a user writes them); the rolling play runs no task (--tags no task has),
    so each batch only gathers facts. A host in `unreachable` points at a closed loopback
    port; one in `failed` has no Python at its interpreter's path, so gathering its facts
    fails. -> (run, [[hosts of batch 1], [batch 2], ...])."""
    inv = tmp_path / "inventory"
    (inv / "group_vars").mkdir(parents=True)
    local = {
        "ansible_connection": "local",
        "ansible_become": False,
        "ansible_python_interpreter": sys.executable,
    }
    dead = {"ansible_connection": "ssh", "ansible_host": "127.0.0.1", "ansible_port": 9}
    hosts = {h: dict(dead if h in unreachable else local) for h in RACK}
    for h in failed:
        hosts[h]["ansible_python_interpreter"] = "/nonexistent/python3"
    (inv / "hosts.yml").write_text(
        yaml.safe_dump({"inference_nodes": {"children": {"rack1": {"hosts": hosts}}}})
    )
    (inv / "group_vars/inference_nodes.yml").write_text(yaml.safe_dump(group_vars))
    playbook = os.path.join(os.path.dirname(sys.executable), "ansible-playbook")
    argv = [
        playbook,
        "-i",
        str(inv),
        str(REPO / "playbooks/rollout.yml"),
        "--tags",
        "rtfleet_no_such_tag",
    ]
    argv += ["--limit", limit] if limit else []
    run = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        env={**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"},
        cwd=REPO,
        check=False,
        timeout=300,
    )
    plays = run.stdout.split("PLAY [Roll out rtfleet, a batch at a time]")[1:]
    batches = [
        sorted(set(re.findall(r"^(?:ok|fatal): \[(h[0-9])\]", play, re.M))) for play in plays
    ]
    return run, batches


@pytest.mark.parametrize("limit", [None, "inference_nodes", "rack1", "h1,h2,h3,h4"])
def test_limit_keeps_the_inventorys_batches(tmp_path, limit):
    # With --limit, the first play of the run used to be skipped and the rolling play's
    # keywords fell back to the default canary: h1 | h2 | h3,h4.
    run, batches = _rack_batches(tmp_path, {"rtfleet_serial": 1}, limit=limit)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert batches == [["h1"], ["h2"], ["h3"], ["h4"]], run.stdout[-3000:]


@pytest.mark.parametrize("fault", ["unreachable", "failed"])
@pytest.mark.parametrize("limit", [None, "rack1"])
@pytest.mark.parametrize(("max_fail", "batches_run"), [(50, 2), (0, 1), (None, 1)])
def test_max_fail_percentage_comes_from_the_inventory(
    tmp_path, limit, max_fail, batches_run, fault
):
    # h1 cannot be reached, or fails (no Python where its interpreter should be): half of the
    # first batch of two is lost. At 50 % the rollout goes on to h3,h4; at 0 (the default) it
    # stops after the first batch. Ansible's max_fail_percentage counted no unreachable host:
    # with it, the rollout went on at 0 %.
    settings = {"rtfleet_serial": 2}
    if max_fail is not None:
        settings["rtfleet_max_fail_percentage"] = max_fail
    run, batches = _rack_batches(tmp_path, settings, limit=limit, **{fault: ("h1",)})
    assert run.returncode != 0
    assert batches == [["h1", "h2"], ["h3", "h4"]][:batches_run], run.stdout[-3000:]
    assert ("UNREACHABLE" if fault == "unreachable" else "fatal: [h1]: FAILED") in run.stdout
    # the peer of the lost host finished its batch; it is stopped only when the rollout stops
    assert re.search(r"^ok: \[h2\]", run.stdout, re.M)
    stopped = "The rollout stops here: no later batch starts." in run.stdout
    assert stopped == (batches_run == 1)


def test_a_limit_that_disagrees_is_refused_before_any_host(tmp_path):
    run, batches = _rack_batches(tmp_path, {"rtfleet_serial": "0"}, limit="rack1")
    assert run.returncode != 0 and batches == []
    assert "rtfleet_serial must be one value for all targeted hosts" in run.stdout


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


def test_a_host_that_fails_a_step_is_in_the_report_with_the_task_it_stopped_at(tmp_path):
    """The canary's host step fails (a bad kernel flavour fails the role's argument spec):
    its rescue records where it stopped and writes the report so far, which builds without
    any post-check result and fails the fleet naming the host and the task."""
    run, started = _rollout(tmp_path, {})
    assert run.returncode != 0 and started == ["n1"], run.stdout[-3000:]
    record = json.loads((tmp_path / "report/results/stopped/n1.json").read_text())
    assert record["host"] == "n1" and "arg spec" in record["task"], record
    assert "rtfleet_host_kernel_flavour" in record["message"], record
    fleet = json.loads((tmp_path / "report/fleet.json").read_text())
    assert fleet["verdict"]["passed"] is False and fleet["verdict"]["failed_hosts"] == ["n1"]
    assert "Stopped migrations" in (tmp_path / "report/report.md").read_text()
    assert not (tmp_path / "report/results/stopped/n2.json").exists()
