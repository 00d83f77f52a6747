"""BIOS checklist: verdicts on generated trees, waivers, bad input, and the Ansible module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_local_playbook

from rtfleet.checklist import ChecklistError, evaluate
from rtfleet.topology import read_topology

REPO = Path(__file__).resolve().parents[2]


def _status(result):
    return {i["item"]: i["status"] for i in result["items"]}


def test_tuned_genoa_passes(trees):
    topo = read_topology(str(trees("epyc-9634-2s")))
    result = evaluate(topo, {"nps": 1, "smt": "off", "frequency_driver": ["amd-pstate-epp"]})
    assert result["ok"], result["failed"]
    status = _status(result)
    assert status["max_idle_latency_us"] == "ok"  # C2 (800 us) is disabled: deepest is C1
    assert status["boost"] == "not_checked"
    assert status["determinism"] == "manual"


def test_untuned_xeon_fails_with_what_to_fix_and_waivers_apply(trees):
    topo = read_topology(str(trees("xeon-2s-smt")))
    result = evaluate(topo, {"nps": 1, "smt": "off", "boost": "off"})
    assert result["failed"] == ["smt", "boost", "max_idle_latency_us", "governor"]
    deepest = next(i for i in result["items"] if i["item"] == "max_idle_latency_us")
    assert deepest["observed"] == 170 and "C6" in deepest["hint"]
    waived = evaluate(topo, {"nps": 1, "smt": "off", "boost": "off"}, ["smt", "governor"])
    assert waived["failed"] == ["boost", "max_idle_latency_us"]
    assert _status(waived)["smt"] == "waived"


def test_nps4_and_l3_as_numa_are_seen(trees):
    assert evaluate(read_topology(str(trees("epyc-7702p-nps4"))), {"nps": 4})["ok"]
    l3_numa = evaluate(read_topology(str(trees("threadripper-l3-as-numa"))), {"nps": 1})
    assert l3_numa["failed"] == ["nps"]  # 4 L3-as-NUMA nodes on one socket read as NPS4


def test_what_the_os_cannot_see_is_manual_not_passed(trees):
    topo = read_topology(str(trees("vmware-88")))  # no cpufreq/cpuidle in this guest
    status = _status(evaluate(topo, {"boost": "on"}))
    assert status["boost"] == "manual"
    assert status["governor"] == "manual"


@pytest.mark.parametrize(
    ("wanted", "waivers", "message"),
    [
        ({"smt": "no"}, (), 'smt must be "on", "off"'),
        ({"nps": 5}, (), "nps must be"),
        ({"frequency_driver": "acpi-cpufreq"}, (), "must be a list"),
        ({"bogus": 1}, (), "unknown checklist items"),
        ({}, ("smtt",), "waivers name unknown items"),
    ],
)
def test_bad_wanted_values_are_refused(trees, wanted, waivers, message):
    topo = read_topology(str(trees("xeon-2s-smt")))
    with pytest.raises(ChecklistError, match=message):
        evaluate(topo, wanted, waivers)


def test_module_fails_the_host_naming_the_items(trees, tmp_path):
    root = trees("xeon-2s-smt")
    playbook = tmp_path / "check.yml"
    playbook.write_text(
        "- hosts: localhost\n  gather_facts: false\n  tasks:\n"
        f"    - rtfleet.fleet.bios_checklist:\n        root: {root}\n"
        "        wanted: {smt: 'off'}\n        waivers: [max_idle_latency_us]\n"
    )
    run = run_local_playbook(playbook, ANSIBLE_STDOUT_CALLBACK="json")
    assert run.returncode == 2
    task = json.loads(run.stdout)["plays"][0]["tasks"][0]["hosts"]["localhost"]
    assert "smt: wanted off, observed on" in task["msg"]
    assert "governor" in task["msg"]
    assert "max_idle_latency_us" not in task["checklist"]["failed"]


def test_memoryless_node_fails_dimm_population(trees, tmp_path):
    """A socket without DIMMs (node 0 memoryless) is flagged, and can be waived."""
    topo = read_topology(str(trees("xeon-2s-memoryless-node0")))
    result = evaluate(topo, {"governor": None, "max_idle_latency_us": None})
    assert result["failed"] == ["memory_on_every_node"]
    item = _status_item(result, "memory_on_every_node")
    assert item["observed"] == [0] and "node 0 has CPUs but no memory" in item["hint"]
    assert evaluate(
        topo, {"governor": None, "max_idle_latency_us": None}, ["memory_on_every_node"]
    )["ok"]
    healthy = evaluate(read_topology(str(trees("epyc-9354-2s-nps4-cxl"))), {"nps": 4})
    assert _status(healthy)["memory_on_every_node"] == "ok"  # CPU-less CXL nodes are fine
    assert _status(healthy)["nps"] == "ok"  # CXL nodes do not count as NPS


def _status_item(result, name):
    return next(i for i in result["items"] if i["item"] == name)
