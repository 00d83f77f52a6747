"""The plan record's one check (module_utils/plan_record), shared by the roles' read_plan
(through the plan_record filter) and the drift guard on the host.

The record of every plan the planner makes for the captured and generated server shapes
stores each CPU set once and reads back as that plan; a schema-1 record (written by the
previous release, tests/fixtures/plan-schema1) reads as the plan today's planner makes; a
record of a schema this collection does not read, or with a malformed CPU set, node or
runtime group, is refused in one line that names what is wrong, by the filter and by
rtfleet-drift alike.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import REPO, run_local_playbook

from rtfleet import drift
from rtfleet.plan_record import (
    READABLE_SCHEMAS,
    SCHEMA_VERSION,
    PlanRecordError,
    parse_plan,
    to_record,
)
from rtfleet.planner import plan_partition
from rtfleet.topology import read_topology

SHAPES = sorted(p.stem for p in (REPO / "tests/fixtures/shapes").glob("*.json"))


def _filter():
    from ansible_collections.rtfleet.fleet.plugins.filter.rtfleet import FilterModule

    return FilterModule().filters()["plan_record"]


@pytest.fixture(scope="module")
def good(trees):
    return plan_partition(read_topology(str(trees("epyc-9634-2s"))), {"runtime_l3_groups": 8})


@pytest.mark.parametrize("shape", SHAPES)
def test_every_plan_the_planner_makes_is_a_record_the_readers_take(trees, shape):
    # The VMware shapes are planned only when told to (a lab); the record is the same kind.
    policy = {"allow_deceptive_topology": True} if shape.startswith("vmware") else {}
    plan = plan_partition(read_topology(str(trees(shape))), policy)
    assert plan["schema"] == SCHEMA_VERSION in READABLE_SCHEMAS
    record = json.dumps(to_record(plan))
    assert parse_plan(record) == plan
    assert _filter()(record, "/etc/rtfleet/plan.json") == {"plan": plan, "error": ""}
    # A reader given the whole plan (not only the record) reads the same plan.
    assert parse_plan(json.dumps(plan)) == plan


def _cpu_sets(value, where=""):
    """Every CPU set a record holds, as (where, sorted CPUs): lists of CPU numbers and
    cpulist/mask strings alike."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _cpu_sets(item, "%s.%s" % (where, key))
    elif isinstance(value, list) and value and all(isinstance(c, int) for c in value):
        yield where, sorted(value)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _cpu_sets(item, "%s[%d]" % (where, i))
    elif isinstance(value, str) and re.match(r"^[0-9][0-9a-f,-]*$", value):
        yield where, value


def test_the_record_stores_each_cpu_set_once(trees):
    plan = plan_partition(
        read_topology(str(trees("xeon-2s-smt"))), {"runtime_threads": "one_thread_per_core"}
    )
    record = to_record(plan)
    found = list(_cpu_sets({k: v for k, v in record.items() if k != "policy"}))
    # No cpulist or mask strings: only lists of CPU numbers, each stored once (a group's
    # worker_cpus is its own set: one thread per core).
    assert [w for w, cpus in found if isinstance(cpus, str)] == []
    assert {w for w, _ in found} >= {".online", ".housekeeping", ".runtime"}
    seen = {}
    for where, cpus in found:
        assert tuple(cpus) not in seen or len(cpus) == 1, (where, seen.get(tuple(cpus)))
        seen[tuple(cpus)] = where
    for gone in ("isolated", "cpulists", "kernel_args", "kubelet", "tuned", "systemd_cpu_affinity"):
        assert gone not in record
    assert not {"cpulist", "systemd"} & set(record["runtime_groups"][0])
    assert all(len(g["worker_cpus"]) * 2 == len(g["cpus"]) for g in record["runtime_groups"])
    # All threads work: the record keeps the group's CPUs once, the plan derives the workers.
    plan = plan_partition(read_topology(str(trees("xeon-2s-smt"))))
    assert all("worker_cpus" not in g for g in to_record(plan)["runtime_groups"])
    assert all(
        g["worker_cpus"] == g["cpus"]
        for g in parse_plan(json.dumps(to_record(plan)))["runtime_groups"]
    )
    assert set(record["numa_nodes"][0]) == {"id", "memory_node", "cpus"}


SCHEMA1 = sorted((REPO / "tests/fixtures/plan-schema1").glob("*.json"))


@pytest.mark.parametrize("path", SCHEMA1, ids=[p.stem for p in SCHEMA1])
def test_a_schema_1_record_reads_as_the_plan_of_today(trees, path):
    fixture = json.loads(path.read_text())
    record = fixture["record"]
    assert record["schema"] == 1 and "cpus" not in record["numa_nodes"][0]
    today = plan_partition(read_topology(str(trees(fixture["shape"]))), fixture["policy"])
    assert parse_plan(json.dumps(record)) == {**today, "schema": 1}
    # What the host step writes on its next run is today's record.
    assert to_record(parse_plan(json.dumps(record))) == to_record(today)


def _edited(plan, edit):
    doc = json.loads(json.dumps(to_record(plan)))
    edit(doc)
    return json.dumps(doc)


HOSTILE = [
    ("not json", lambda p: None, "not JSON"),
    ("[1, 2]", None, "not a JSON object"),
    ("null", None, "not a JSON object"),
    (None, lambda p: p.update(schema=3), "plan schema 3 is not one this collection reads (1, 2)"),
    (None, lambda p: p.pop("schema"), "plan schema null is not one"),
    (None, lambda p: p.update(schema="1"), 'plan schema "1" is not one'),
    (None, lambda p: p.update(schema=True), "plan schema true is not one"),
    (None, lambda p: p.pop("runtime"), "no runtime in the plan record"),
    (None, lambda p: p.pop("numa_nodes"), "no numa_nodes in the plan record"),
    (None, lambda p: p.update(housekeeping="0-3"), "housekeeping is not a list of CPU numbers"),
    (None, lambda p: p.update(runtime=[1, -2]), "runtime is not a list of CPU numbers"),
    (None, lambda p: p.update(policy=[]), "policy is not an object"),
    (None, lambda p: p["policy"].update(isolate="runtime"), "policy isolate is not a list"),
    (None, lambda p: p.update(warnings="x"), "warnings is not a list of strings"),
    (None, lambda p: p.update(numa_nodes=[1]), "numa_nodes is not a list of nodes"),
    (None, lambda p: p["numa_nodes"][0].pop("cpus"), "NUMA node 0: cpus is not a list of CPU"),
    (None, lambda p: p["numa_nodes"][0].update(id="0"), "a NUMA node's id is not a number"),
    (None, lambda p: p["numa_nodes"][0].update(memory_node=None), "memory_node is not a number"),
    (None, lambda p: p.update(online=[0, True]), "online is not a list of CPU numbers"),
    (None, lambda p: p.update(pod_pool=[1.5]), "pod_pool is not a list of CPU numbers"),
    (None, lambda p: p.update(runtime_groups={}), "runtime_groups is not a list"),
    (None, lambda p: p["runtime_groups"].append("ccx9"), "a runtime group without name or cpus"),
    (None, lambda p: p["runtime_groups"][0].pop("cpus"), "a runtime group without name or cpus"),
    (None, lambda p: p["runtime_groups"][0].update(name="../x"), "'../x' is not [A-Za-z0-9_-]+"),
    (None, lambda p: p["runtime_groups"][0].update(name="a\nb"), "is not [A-Za-z0-9_-]+"),
    (None, lambda p: p["runtime_groups"][0].update(cpus="1-3"), "cpus is not a list of CPU"),
    (None, lambda p: p["runtime_groups"][0].update(worker_cpus=0), "worker_cpus is not a list"),
    (None, lambda p: p["runtime_groups"][0].update(numa_node=-1), "numa_node is not a number"),
    (None, lambda p: p["runtime_groups"][0].update(sampler_cpus=[None]), "sampler_cpus is not"),
]


@pytest.mark.parametrize(("text", "edit", "message"), HOSTILE)
def test_a_record_the_readers_cannot_use_is_refused_in_one_line(good, text, edit, message):
    text = text if text is not None else _edited(good, edit)
    with pytest.raises(PlanRecordError) as caught:
        parse_plan(text)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)
    filtered = _filter()(text, "/etc/rtfleet/plan.json")
    assert filtered["plan"] == {}
    assert filtered["error"] == "cannot use /etc/rtfleet/plan.json: %s" % caught.value


@pytest.mark.parametrize(("text", "edit", "message"), [h for h in HOSTILE if h[0] is None])
def test_the_drift_guard_refuses_the_same_records(tmp_path, good, text, edit, message):
    etc = tmp_path / "etc/rtfleet"
    etc.mkdir(parents=True)
    (etc / "plan.json").write_text(_edited(good, edit))
    (etc / "host.json").write_text(json.dumps({"kernel_args": []}))
    with pytest.raises(drift.RecordError) as caught:
        drift.load_records(str(tmp_path))
    assert str(caught.value).startswith("cannot use %s: " % Path(tmp_path, "etc/rtfleet/plan.json"))
    assert message in str(caught.value)


def _read_plan(tmp_path, plan_file, *args, before=None, required=True):
    """rtfleet_host's read_plan on localhost; what it left: {"plan", "found"}."""
    out = tmp_path / "left.json"
    tasks = []
    if before is not None:  # what the host role's `plan` entry point computed in this run
        tasks.append({"ansible.builtin.set_fact": {"rtfleet_host_plan": before}})
    tasks += [
        {
            "ansible.builtin.include_role": {
                "name": "rtfleet.fleet.rtfleet_host",
                "tasks_from": "read_plan",
            },
            "vars": {
                "rtfleet_host_plan_file": str(plan_file),
                "rtfleet_host_plan_required": required,
            },
        },
        {
            "ansible.builtin.copy": {
                "content": '{{ {"plan": rtfleet_host_plan, "found": rtfleet_host_plan_found}'
                " | to_json }}",
                "dest": str(out),
            },
            "check_mode": False,
        },
    ]
    playbook = tmp_path / "read.yml"
    playbook.write_text(json.dumps([{"hosts": "localhost", "gather_facts": False, "tasks": tasks}]))
    run = run_local_playbook(playbook, *args)
    assert run.returncode == 0, run.stdout[-3000:]
    return json.loads(out.read_text())


def test_read_plan_keeps_the_record_or_this_runs_plan_in_check_mode(tmp_path, good):
    recorded = tmp_path / "plan.json"
    recorded.write_text(json.dumps(to_record(good)))
    assert _read_plan(tmp_path, recorded) == {"plan": good, "found": True}
    # Check mode after the host role computed the plan (it records nothing in check mode):
    # that plan, though no record exists.
    computed = {**good, "cpulists": {**good["cpulists"], "isolated": "computed"}}
    missing = tmp_path / "none.json"
    assert _read_plan(tmp_path, missing, "--check", before=computed) == {
        "plan": computed,
        "found": True,
    }
    # Check mode without a computed plan reads the record.
    assert _read_plan(tmp_path, recorded, "--check") == {"plan": good, "found": True}
    # No record, not required (a baseline host, the samplers playbook): found false, no plan.
    assert _read_plan(tmp_path, missing, required=False) == {"plan": {}, "found": False}
