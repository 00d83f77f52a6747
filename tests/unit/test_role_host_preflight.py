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
            "tasks": [
                {
                    # Only the preflight entry point: the rest of the role changes a host.
                    "ansible.builtin.include_role": {
                        "name": "rtfleet.fleet.rtfleet_host",
                        "tasks_from": "preflight",
                    },
                    "vars": {"rtfleet_host_sysfs_root": str(root), **role_vars},
                },
                {
                    "ansible.builtin.copy": {
                        "dest": str(out),
                        "content": "{{ {'plan': rtfleet_host_plan,"
                        " 'args': rtfleet_host_kernel_args}"
                        " | to_json }}",
                        "mode": "0644",
                    }
                },
            ],
        }
    ]
    playbook = tmp_path / "preflight.yml"
    playbook.write_text(yaml.safe_dump(play))
    run = run_local_playbook(playbook, ANSIBLE_STDOUT_CALLBACK="json")
    data = json.loads(out.read_text()) if out.exists() else {"plan": None, "args": None}
    return run, data["plan"], data["args"]


def _failure(run):
    for play in json.loads(run.stdout)["plays"]:
        for task in play["tasks"]:
            result = task["hosts"].get("localhost", {})
            if result.get("failed"):
                return task["task"]["name"], result["msg"]
    return None


def test_bare_metal_host_passes_and_gets_its_plan(trees, tmp_path):
    run, plan, args = _run(
        tmp_path,
        trees("epyc-9634-2s"),
        rtfleet_host_policy={"partial_l3_groups": "pod_pool"},
        rtfleet_host_bios_wanted={"nps": 1, "smt": "off"},
        rtfleet_host_hugepages_per_node={0: 1024, 1: 512},
    )
    assert run.returncode == 0, _failure(run)
    assert len(plan["runtime_groups"]) == 22
    assert plan["kubelet"]["reservedSystemCPUs"]
    # The command line: the plan's isolation, then the host-wide arguments for an AMD host.
    assert args[: len(plan["kernel_args"])] == plan["kernel_args"]
    assert {
        "processor.max_cstate=1",
        "amd_pstate=active",
        "panic=10",
    } <= set(args)
    # 2M pages are allocated per node by rtfleet-host-tune at boot, not on the command line.
    assert not [a for a in args if a.startswith("hugepages")]
    assert not [a for a in args if a.startswith("intel_idle")]


def test_deceptive_vm_is_refused_with_evidence(trees, tmp_path):
    run, plan, _ = _run(tmp_path, trees("vmware-88"), rtfleet_host_allow_virtual=True)
    assert run.returncode == 2 and plan is None
    name, msg = _failure(run)
    assert name.endswith("Refuse a virtual machine that hides its topology")
    assert "88 CPUs are presented as 88 sockets" in msg and "docs/migration.md" in msg


def test_bad_policy_fails_before_anything_changes(trees, tmp_path):
    run, _, _ = _run(tmp_path, trees("xeon-2s-smt"), rtfleet_host_policy={"housekeeping_cpus": "0"})
    assert run.returncode == 2
    assert "splits the SMT core 0,80" in _failure(run)[1]


@pytest.mark.parametrize(
    ("role_vars", "message"),
    [
        ({"rtfleet_host_kernel_flavour": "realtime"}, "rtfleet_host_kernel_flavour"),
        ({"rtfleet_host_bios_wanted": {"smt": "off"}}, "smt: wanted off, observed on"),
        ({"rtfleet_host_cmdline_extra": ["nohz_full=2"]}, "conflicts with 'nohz_full="),
        (
            {"rtfleet_host_cmdline_extra": ["root=/dev/sdb1"]},
            "belongs to the distribution's boot entry",
        ),
        ({"rtfleet_host_hugepages_per_node": {7: 16}}, "NUMA node 7 does not exist"),
        ({"rtfleet_host_hugepages_per_node": 10**6}, "lower the count"),
        (
            {"rtfleet_host_sched_rt_runtime_us": 2000000},
            "rtfleet_host_sched_rt_runtime_us must be -1",
        ),
        ({"rtfleet_host_irq_mode": "magic"}, "rtfleet_host_irq_mode"),
        ({"rtfleet_host_drift_interval_s": 5}, "rtfleet_host_drift_interval_s must be"),
        ({"rtfleet_host_drift_interval_s": "5min"}, "rtfleet_host_drift_interval_s"),
        (
            {"rtfleet_host_drift_textfile_dir": "var/lib/node-exporter"},
            "rtfleet_host_drift_textfile_dir (var/lib/node-exporter) and",
        ),
    ],
)
def test_bad_variables_and_bios_mismatch_are_refused(trees, tmp_path, role_vars, message):
    run, _, _ = _run(tmp_path, trees("xeon-2s-smt"), **role_vars)
    assert run.returncode == 2
    assert message in _failure(run)[1]


def test_intel_host_gets_intel_idle_limit(trees, tmp_path):
    run, _, args = _run(tmp_path, trees("xeon-2s-smt"), rtfleet_host_max_cstate=0)
    assert run.returncode == 0, _failure(run)
    assert {"intel_idle.max_cstate=0", "processor.max_cstate=1"} <= set(args)
    assert not [a for a in args if a.startswith("amd_pstate")]


def test_host_without_cgroup_v2_is_refused_before_anything_changes(tmp_path):
    from sysfs_gen import build_tree, load_shape

    root = build_tree({**load_shape("xeon-2s-smt"), "cgroup": "v1"}, tmp_path / "v1")
    run, _, _ = _run(tmp_path, root)
    name, msg = _failure(run)
    assert name.startswith("rtfleet.fleet.rtfleet_host : Refuse a host without cgroup v2")
    assert "unified cgroup hierarchy" in msg and "Nothing was changed" in msg
    # Turned off, the role does not ask for it.
    run, plan, _ = _run(tmp_path, root, rtfleet_host_confine_system_slices=False)
    assert run.returncode == 0 and plan
