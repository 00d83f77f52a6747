"""The post-check's targets and result (module_utils/postcheck_result), which the role's
read and gate steps call through the postcheck_targets and postcheck_result filters.

Built from captured tool output (tests/fixtures: cyclictest with a starved thread's
``-nan``, oslat) and plans of server shapes; every result passes the schema check and the
gate reads it as the role's result.
"""

from __future__ import annotations

import base64
import json

import pytest
from conftest import REPO
from postcheck_results import smoke_entry

from rtfleet.planner import plan_partition
from rtfleet.postcheck import PostcheckError, validate_result
from rtfleet.postcheck_gate import gate_host
from rtfleet.postcheck_result import assemble_result, measure_targets
from rtfleet.topology import read_topology

FIXTURES = REPO / "tests/fixtures"
THRESHOLDS = {"cyclictest_max_us": 100, "oslat_max_us": 100, "smoke_max_jitter": None}


def _filters():
    from ansible_collections.rtfleet.fleet.plugins.filter.rtfleet import FilterModule

    return FilterModule().filters()


@pytest.fixture(scope="module")
def plan(trees):
    return plan_partition(read_topology(str(trees("epyc-9634-2s"))))


def test_a_tuned_host_measures_its_isolated_cpus_and_smokes_each_unit_near_its_samplers(plan):
    online = plan["online"]
    targets = _filters()["postcheck_targets"](plan, online, "tuned", None, True)
    assert targets == measure_targets(plan, online, "tuned")
    assert targets["cpus"] == plan["cpulists"]["isolated"]
    assert targets["housekeeping"] == plan["cpulists"]["housekeeping"]
    assert targets["units"] == [g["name"] for g in plan["runtime_groups"]]
    assert len(targets["units"]) > 8  # one unit per L3 group of a 2-socket server
    for group, cpu, why in zip(plan["runtime_groups"], targets["clients"], targets["clients_from"]):
        assert cpu == group["sampler_cpus"][0] and why == group["sampler_cpus_from"]
    # rtfleet_postcheck_cpus overrides what is measured; smoke off tests no unit.
    chosen = measure_targets(plan, online, "tuned", "2-3", smoke=False)
    assert chosen["cpus"] == "2-3" and chosen["units"] == []


def test_a_baseline_host_measures_all_but_its_first_cpu_and_smokes_no_unit():
    targets = measure_targets({}, list(range(88)), "baseline")
    assert targets == {
        "cpus": "1-87",
        "housekeeping": "0",
        "units": [],
        "clients": [],
        "clients_from": [],
    }


def test_a_plan_record_without_sampler_cpus_smokes_from_housekeeping(plan):
    old = {**plan, "runtime_groups": [{"name": g["name"]} for g in plan["runtime_groups"]]}
    targets = measure_targets(old, plan["online"], "tuned")
    assert set(targets["clients"]) == {plan["housekeeping"][0]}
    assert set(targets["clients_from"]) == {"housekeeping (plan record without sampler CPUs)"}


def _b64(path):
    return base64.b64encode((FIXTURES / path).read_bytes()).decode()


def _measured(plan, **over):
    targets = measure_targets(plan, plan["online"], "tuned")
    measured = {
        "host": "epyc1",
        "kind": "tuned",
        "collected_at": "2026-12-06T05:00:00Z",
        "virtualization": "none\n",
        "running": {"release": "6.1.0-28-rt-amd64", "realtime": True, "args": ["ro", "quiet"]},
        "housekeeping": targets["housekeeping"],
        "plan": plan,
        "hwlatdetect": {"skipped": "rtfleet_postcheck_hwlatdetect is false"},
        "hardware_failures": [],
        "cyclictest_b64": _b64("cyclictest/starved-thread-nan.json"),
        "oslat_b64": _b64("oslat/cpu1-rtprio.json"),
        "load": "hackbench -l 1000",
        "seconds": {"cyclictest": "60", "oslat": 30},
        "cpus": targets["cpus"],
        "oslat_priority": "1",
        "run": {"cyclictest": True, "oslat": True},
        "not_run": {"oslat": {"skipped": "rtfleet_postcheck_oslat is false"}},
        "smoke_stdout": [json.dumps(smoke_entry(unit)) for unit in targets["units"][:2]],
        "clients": targets["clients"],
        "clients_from": targets["clients_from"],
        "consistency": [{"check": "x", "ok": True, "detail": ""}],
    }
    measured.update(over)
    return measured


def test_the_result_carries_what_was_run_and_passes_the_schema_check(plan):
    result = _filters()["postcheck_result"](_measured(plan), THRESHOLDS)
    checked = validate_result(result)  # the report's reader adds an empty gate
    assert {k: v for k, v in checked.items() if k != "gate"} == result
    assert result["virtualization"] == "none"
    assert result["kernel"] == {
        "release": "6.1.0-28-rt-amd64",
        "realtime": True,
        "cmdline": "ro quiet",
    }
    assert result["plan"]["isolated"] == plan["cpulists"]["isolated"]
    assert result["plan"]["runtime_groups"] == {
        g["name"]: g["cpulist"] for g in plan["runtime_groups"]
    }
    # cyclictest's -nan (a thread that never ran) is read as null, not refused.
    threads = result["cyclictest"]["json"]["thread"]
    assert None in [t.get("avg") for t in threads.values()]
    assert result["cyclictest"]["duration_s"] == 60 and result["oslat"]["priority"] == 1
    assert [s["client_cpu"] for s in result["smoke"]] == _measured(plan)["clients"][:2]
    assert result["smoke"][0]["client_cpu_from"] == plan["runtime_groups"][0]["sampler_cpus_from"]
    assert result["thresholds"] == THRESHOLDS
    assert "gate" not in result and gate_host(result)["failures"]  # the starved thread fails


def test_tools_that_did_not_run_say_why(plan):
    failed_first = _measured(
        plan,
        cyclictest_b64=None,
        oslat_b64=None,
        hardware_failures=["hwlatdetect: 54 us > 20 us"],
        smoke_stdout=[],
        virtualization="",
    )
    result = assemble_result(failed_first, THRESHOLDS)
    skipped = {"skipped": "hwlatdetect failed first (hwlatdetect: 54 us > 20 us)"}
    assert result["cyclictest"] == skipped and result["oslat"] == skipped
    assert result["smoke"] == [] and result["virtualization"] is None
    off = _measured(plan, cyclictest_b64=None, oslat_b64=None, run={"cyclictest": False})
    result = assemble_result(off, THRESHOLDS)
    assert result["cyclictest"] is None
    assert result["oslat"] == {"skipped": "rtfleet_postcheck_oslat is false"}


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"cyclictest_b64": base64.b64encode(b"\x00garbage").decode()}, "cyclictest wrote no JSON"),
        ({"oslat_b64": base64.b64encode(b"{").decode()}, "oslat wrote no JSON"),
        ({"smoke_stdout": ["Traceback (most recent call last):"]}, "shminfer smoke wrote no JSON"),
    ],
)
def test_a_tool_that_wrote_no_document_is_one_line(plan, over, message):
    with pytest.raises(PostcheckError, match=message) as caught:
        assemble_result(_measured(plan, **over), THRESHOLDS)
    assert "\n" not in str(caught.value)
    from ansible.errors import AnsibleFilterError

    with pytest.raises(AnsibleFilterError, match="postcheck result of epyc1: " + message):
        _filters()["postcheck_result"](_measured(plan, **over), THRESHOLDS)
