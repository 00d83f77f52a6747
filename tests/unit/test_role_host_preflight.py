"""rtfleet_host preflight, run by ansible-playbook against generated sysfs trees.

Preflight only reads, so it runs on localhost with the tree as its root: real role, real
module, real filter, no VM. What must hold: a bare-metal host passes and gets its plan;
VMs, bad policies, bad variables and BIOS mismatches are refused with a message that says
what to change.
"""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import run_local_playbook


def _run(tmp_path, root, **role_vars):
    out = tmp_path / "plan.json"
    play = [
        {
            "name": "Preflight",
            "hosts": "localhost",
            "gather_facts": False,
            "roles": [
                {
                    "role": "rtfleet_host",
                    "vars": {"rtfleet_host_sysfs_root": str(root), **role_vars},
                }
            ],
            "post_tasks": [
                {
                    "ansible.builtin.copy": {
                        "dest": str(out),
                        "content": "{{ rtfleet_host_plan | to_json }}",
                        "mode": "0644",
                    }
                }
            ],
        }
    ]
    playbook = tmp_path / "preflight.yml"
    playbook.write_text(yaml.safe_dump(play))
    run = run_local_playbook(playbook, ANSIBLE_STDOUT_CALLBACK="json")
    plan = json.loads(out.read_text()) if out.exists() else None
    return run, plan


def _failure(run):
    for play in json.loads(run.stdout)["plays"]:
        for task in play["tasks"]:
            result = task["hosts"].get("localhost", {})
            if result.get("failed"):
                return task["task"]["name"], result["msg"]
    return None


def test_bare_metal_host_passes_and_gets_its_plan(trees, tmp_path):
    run, plan = _run(
        tmp_path,
        trees("epyc-9634-2s"),
        rtfleet_host_policy={"partial_l3_groups": "pod_pool"},
        rtfleet_host_bios_wanted={"nps": 1, "smt": "off"},
    )
    assert run.returncode == 0, _failure(run)
    assert len(plan["runtime_groups"]) == 22
    assert plan["kubelet"]["reservedSystemCPUs"]


def test_deceptive_vm_is_refused_with_evidence(trees, tmp_path):
    run, plan = _run(tmp_path, trees("vmware-88"), rtfleet_host_allow_virtual=True)
    assert run.returncode == 2 and plan is None
    name, msg = _failure(run)
    assert name.endswith("Refuse a virtual machine that hides its topology")
    assert "88 CPUs are presented as 88 sockets" in msg and "docs/migration.md" in msg


def test_bad_policy_fails_before_anything_changes(trees, tmp_path):
    run, _ = _run(tmp_path, trees("xeon-2s-smt"), rtfleet_host_policy={"housekeeping_cpus": "0"})
    assert run.returncode == 2
    assert "splits the SMT core 0,80" in _failure(run)[1]


@pytest.mark.parametrize(
    ("role_vars", "message"),
    [
        ({"rtfleet_host_kernel_flavour": "realtime"}, "rtfleet_host_kernel_flavour"),
        ({"rtfleet_host_bios_wanted": {"smt": "off"}}, "smt: wanted off, observed on"),
    ],
)
def test_bad_variables_and_bios_mismatch_are_refused(trees, tmp_path, role_vars, message):
    run, _ = _run(tmp_path, trees("xeon-2s-smt"), **role_vars)
    assert run.returncode == 2
    assert message in _failure(run)[1]
