"""Post-check evaluation: cyclictest parsing, percentiles, gates, the Ansible filters."""

from __future__ import annotations

import importlib.util
import json
import re

import numpy as np
import pytest
from postcheck_results import CYCLICTEST, cyclictest_doc, host_result, smoke_entry

from rtfleet.postcheck import PostcheckError, validate_result
from rtfleet.postcheck_gate import (
    DEFAULT_THRESHOLDS,
    cyclictest_thresholds,
    gate_cyclictest,
    gate_host,
)
from rtfleet.postcheck_parse import format_percentile, parse_cyclictest


def _doc(histogram: dict, cycles: int, *, hist_us: int = 200, max_us: int | None = None):
    """A minimal cyclictest document with one thread on CPU 3."""
    top = max((int(k) for k in histogram), default=0)
    return {
        "file_version": 1,
        "cmdline:": f"cyclictest --threads -a 3 --histogram={hist_us} --json=/tmp/x.json",
        "rt_test_version:": "2.40",
        "return_code": 0,
        "sysinfo": {"release": "6.12.0-rt", "realtime": 1},
        "num_threads": 1,
        "thread": {
            "0": {
                "histogram": {str(k): v for k, v in histogram.items()},
                "cycles": cycles,
                "min": min(int(k) for k in histogram) if histogram else 1,
                "max": max_us if max_us is not None else top,
                "avg": 5.0,
                "cpu": 3,
                "node": 0,
            }
        },
    }


def _row(doc):
    return parse_cyclictest(doc)["cpus"][0]


# --------------------------------------------------------------------------- percentiles


def test_percentiles_by_hand():
    # 100 cycles: 90 at 5 us, 9 at 10 us, 1 at 50 us.
    # p99 = 99th smallest = 10 us; p99.9 rank ceil(99.9) = 100 -> the 50 us cycle.
    row = _row(_doc({5: 90, 10: 9, 50: 1}, 100))
    assert (row["p99_us"], row["p999_us"]) == (10, 50)
    assert row["overflows"] == 0
    assert not row["p99_beyond_histogram"] and not row["p999_beyond_histogram"]


def test_percentile_rank_boundary():
    # 1000 cycles, 989 at 5 us: rank 990 is the first 10 us cycle (off by one shows here).
    assert _row(_doc({5: 989, 10: 11}, 1000))["p99_us"] == 10
    assert _row(_doc({5: 990, 10: 10}, 1000))["p99_us"] == 5
    # p99.9 of 1000 cycles is the 999th, so one slow cycle does not reach it.
    row = _row(_doc({5: 999, 60: 1}, 1000))
    assert row["p999_us"] == 5


def test_overflows_make_a_percentile_a_bound_not_a_number():
    # 10 overflows in 1000 cycles: rank 990 still inside the histogram, rank 999 not.
    row = _row(_doc({5: 990}, 1000, max_us=900))
    assert row["overflows"] == 10
    assert (row["p99_us"], row["p99_beyond_histogram"]) == (5, False)
    assert (row["p999_us"], row["p999_beyond_histogram"]) == (None, True)
    assert format_percentile(row, "p999", 200) == "≥ 200"
    # 11 overflows: p99's rank 990 falls among them too.
    row = _row(_doc({5: 989}, 1000, max_us=900))
    assert row["p99_us"] is None and row["p99_beyond_histogram"]


def test_worst_percentile_summary_prefers_the_bound():
    doc = _doc({5: 990}, 1000, max_us=900)
    doc["thread"]["1"] = dict(doc["thread"]["0"], cpu=4, histogram={"7": 1000}, max=7)
    summary = parse_cyclictest(doc)["summary"]
    assert summary["p999_beyond_histogram"] and summary["p999_cpu"] == 3
    assert summary["p99_us"] == 7 and summary["p99_cpu"] == 4
    assert (summary["max_us"], summary["max_cpu"]) == (900, 3)
    assert summary["cpus"] == "3-4" and summary["cycles"] == 2000


# --------------------------------------------------------------------------- real files


def _histfile(name):
    """cyclictest's own --histfile text: per-bucket counts and its summary lines."""
    buckets, footer = {}, {}
    for line in (CYCLICTEST / name).read_text().splitlines():
        if line.startswith("# ") and ":" in line:
            label, _, values = line[2:].partition(":")
            footer[label] = [int(v) for v in values.split()] if values.strip() else []
        elif line and not line.startswith("#"):
            latency, *counts = (int(v) for v in line.split())
            buckets[latency] = counts
    return buckets, footer


def test_real_capture_agrees_with_cyclictests_own_histogram_file():
    parsed = parse_cyclictest(cyclictest_doc("hist200-histfile"))
    buckets, footer = _histfile("hist200-histfile.hist")
    rows = parsed["cpus"]
    assert [r["overflows"] for r in rows] == footer["Histogram Overflows"]  # 33, 34
    assert [r["max_us"] for r in rows] == footer["Max Latencies"]
    assert [r["min_us"] for r in rows] == footer["Min Latencies"]
    assert [sum(c for _, c in r["histogram"]) for r in rows] == footer["Total"]
    for i, row in enumerate(rows):
        assert dict(map(tuple, row["histogram"])) == {
            latency: counts[i] for latency, counts in buckets.items() if counts[i]
        }
    # 33 of 2998 cycles overflowed: more than the 30 p99 may lose, so p99 is a bound.
    assert rows[0]["p99_us"] is None and rows[0]["p99_beyond_histogram"]
    assert parsed["summary"]["histogram_us"] == 200
    assert parsed["summary"]["version"] == "2.40"  # from the "rt_test_version:" key
    assert parsed["summary"]["cmdline"].startswith("cyclictest --mlockall")
    assert parsed["summary"]["realtime"] is False


def _nearest_rank(row, q):
    """Independent oracle: expand the histogram, overflows as +inf, numpy's inverted CDF."""
    samples = np.repeat([b for b, _ in row["histogram"]], [c for _, c in row["histogram"]])
    samples = np.concatenate([samples, np.full(row["overflows"], np.inf)])
    return float(np.quantile(samples, q, method="inverted_cdf"))


@pytest.mark.parametrize("name", ["hist200-overflow", "hist50000-complete", "hist200-histfile"])
def test_real_capture_percentiles_match_numpy(name):
    for row in parse_cyclictest(cyclictest_doc(name))["cpus"]:
        for key, q in (("p99", 0.99), ("p999", 0.999)):
            expected = _nearest_rank(row, q)
            if expected == np.inf:
                assert row[key + "_beyond_histogram"] and row[key + "_us"] is None
            else:
                assert row[key + "_us"] == expected and not row[key + "_beyond_histogram"]


def test_big_histogram_has_no_overflows_and_real_numbers():
    parsed = parse_cyclictest(cyclictest_doc("hist50000-complete"))
    assert parsed["summary"]["overflows"] == 0
    assert [r["cycles"] for r in parsed["cpus"]] == [2996, 2998]
    assert [r["p999_us"] for r in parsed["cpus"]] == [1170, 753]
    assert parsed["summary"]["p999_us"] == 1170 and parsed["summary"]["max_us"] == 2218


def test_string_and_dict_input_agree():
    text = (CYCLICTEST / "hist200-overflow.json").read_text()
    assert parse_cyclictest(text) == parse_cyclictest(json.loads(text))


def test_run_without_histogram_has_no_percentiles():
    parsed = parse_cyclictest(cyclictest_doc("no-histogram"))
    row = parsed["cpus"][0]
    assert row["histogram"] is None and row["overflows"] is None
    assert row["p999_us"] is None and not row["p999_beyond_histogram"]
    assert format_percentile(row, "p999") == "n/a"
    # The max still gates; p99.9 cannot, and the message says how to fix the run.
    failures = gate_cyclictest(parsed, {"max_us": 5000, "min_cycles": None, "p999_us": 100})
    assert failures == [
        "cyclictest ran without --histogram, so p99.9 cannot be checked against the 100 µs "
        "limit: add --histogram=<µs above the limit>"
    ]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(return_code=1), "exited with return code 1"),
        (lambda d: d.update(thread={}), "no measurement threads"),
        (lambda d: d.pop("thread"), "no measurement threads"),
        (lambda d: d["thread"]["0"].update(cycles=0), "thread 0 (CPU 0) ran 0 cycles"),
        (lambda d: d["thread"]["0"].pop("max"), "thread 0 has no 'max'"),
        (lambda d: d["thread"]["0"].update(histogram={"x": 1}), "histogram bucket is 'x'"),
        (lambda d: d.update({"cmdline:": d["cmdline:"] + " -N"}), "--nsecs"),
    ],
)
def test_malformed_documents_say_what_to_fix(mutate, message):
    doc = cyclictest_doc("hist200-overflow")
    mutate(doc)
    with pytest.raises(PostcheckError, match=re.escape(message)):
        parse_cyclictest(doc)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ("", "JSON is empty"),
        ('{"thread": ', "not valid JSON"),
        ([1, 2], "got list"),
        ({"foo": 1}, "not cyclictest --json output"),
    ],
)
def test_not_cyclictest_at_all(doc, message):
    with pytest.raises(PostcheckError, match=re.escape(message)):
        parse_cyclictest(doc)


# --------------------------------------------------------------------------- gates


def test_gate_messages_name_value_limit_and_cpus():
    parsed = parse_cyclictest(cyclictest_doc("hist200-overflow"))
    assert gate_cyclictest(parsed) == [
        "cyclictest ran only 2992 cycles on CPU 1, fewer than the 10000 minimum (2 of 2 CPUs "
        "short: CPU 1 2992, CPU 0 3000): run it longer (--duration) so the worst case means "
        "something",
        "cyclictest max latency 2906 µs on CPU 1 exceeds the 100 µs limit (2 of 2 CPUs over: "
        "CPU 1 2906 µs, CPU 0 876 µs)",
    ]


def test_gate_limits_are_inclusive_and_can_be_switched_off():
    parsed = parse_cyclictest(cyclictest_doc("hist200-overflow"))
    assert gate_cyclictest(parsed, {"max_us": 2906, "min_cycles": 2992}) == []
    assert gate_cyclictest(parsed, {"max_us": 2905, "min_cycles": None}) == [
        "cyclictest max latency 2906 µs on CPU 1 exceeds the 2905 µs limit (1 of 2 CPUs over: "
        "CPU 1 2906 µs)"
    ]
    # Ansible may template numbers into strings.
    assert gate_cyclictest(parsed, {"max_us": "3000", "min_cycles": "100"}) == []


def test_p999_gate_on_a_bound():
    parsed = parse_cyclictest(cyclictest_doc("hist200-overflow"))  # p99.9 >= 200 on both
    loose = {"max_us": None, "min_cycles": None}
    # >= 200 is certainly over a 150 us limit.
    assert gate_cyclictest(parsed, {**loose, "p999_us": 150}) == [
        "cyclictest p99.9 latency ≥ 200 µs on CPU 0 exceeds the 150 µs limit (2 of 2 CPUs "
        "over: CPU 0 ≥ 200 µs, CPU 1 ≥ 200 µs)"
    ]
    # >= 200 against a 300 us limit cannot be decided: that fails too, with the fix.
    (failure,) = gate_cyclictest(parsed, {**loose, "p999_us": 300})
    assert "lies beyond the 200 µs histogram" in failure
    assert "rerun with --histogram above the limit" in failure
    full = parse_cyclictest(cyclictest_doc("hist50000-complete"))
    assert gate_cyclictest(full, {**loose, "p999_us": 1170}) == []
    assert gate_cyclictest(full, {**loose, "p999_us": 1000}) == [
        "cyclictest p99.9 latency 1170 µs on CPU 0 exceeds the 1000 µs limit (1 of 2 CPUs "
        "over: CPU 0 1170 µs)"
    ]


def test_gate_accepts_the_raw_document_and_rejects_unknown_limits():
    doc = cyclictest_doc("hist50000-complete")
    assert gate_cyclictest(doc, {"max_us": 3000, "min_cycles": 100}) == []
    with pytest.raises(PostcheckError, match=r"unknown cyclictest threshold.*max_usec"):
        gate_cyclictest(doc, {"max_usec": 10})
    with pytest.raises(PostcheckError, match="expected a number"):
        gate_cyclictest(doc, {"max_us": "fast"})
    assert DEFAULT_THRESHOLDS["max_us"] == 100


def test_host_thresholds_map_to_gate_keys():
    assert cyclictest_thresholds(
        {"cyclictest_max_us": 50, "cyclictest_p999_us": 20, "smoke_max_p99_ms": 5}
    ) == {"max_us": 50, "p999_us": 20}


def test_gate_host_combines_every_source():
    result = host_result(
        cyclictest="hist200-overflow",
        smoke=[
            smoke_entry("resnet"),
            smoke_entry("bert", failures=["latency p99 7.100 ms > 5.0 ms", "2 errors > 0"]),
        ],
        consistency=[
            {"check": "isolated CPUs", "ok": True, "detail": "1"},
            {"check": "rt kernel", "ok": False, "detail": "PREEMPT_DYNAMIC, wanted PREEMPT_RT"},
        ],
        thresholds={"cyclictest_max_us": 1000, "cyclictest_min_cycles": 1000},
    )
    gate = gate_host(result)
    assert gate == {
        "passed": False,
        "verdict": "failed",
        "failures": [
            "cyclictest max latency 2906 µs on CPU 1 exceeds the 1000 µs limit (1 of 2 CPUs "
            "over: CPU 1 2906 µs)",
            # oslat_max_us unset: the cyclictest limit is oslat's too (OpenShift's one bar)
            "oslat max latency 354113 µs on CPU 1 exceeds the 1000 µs limit (2 of 2 CPUs "
            "over: CPU 1 354113 µs, CPU 0 87923 µs)",
            "smoke bert: latency p99 7.100 ms > 5.0 ms",
            "smoke bert: 2 errors > 0",
            "consistency rt kernel: PREEMPT_DYNAMIC, wanted PREEMPT_RT",
        ],
    }
    # The default limit (100 us) applies when the host names none.
    result["thresholds"] = {"cyclictest_min_cycles": 1000}
    assert "exceeds the 100 µs limit" in gate_host(result)["failures"][0]


def test_gate_host_passes_a_clean_host():
    assert gate_host(host_result()) == {"passed": True, "verdict": "passed", "failures": []}


def test_gate_host_tuned_needs_a_run_baseline_does_not():
    assert gate_host(host_result(cyclictest=None))["failures"] == [
        "no cyclictest run recorded: the post-check must measure a tuned host"
    ]
    assert gate_host(host_result(kind="baseline", cyclictest=None))["passed"]


def test_gate_host_reports_a_broken_run_as_a_failure():
    result = host_result()
    result["cyclictest"]["json"]["return_code"] = 255
    (failure,) = gate_host(result)["failures"]
    assert failure.startswith("cyclictest: cyclictest exited with return code 255")


def test_gate_host_checks_cyclictest_measured_the_cpus_asked_for():
    result = host_result()
    result["cyclictest"]["cpus"] = "0-3"
    (failure,) = gate_host(result)["failures"]
    assert failure.startswith(
        "cyclictest measured CPUs 0-1 but the post-check asked for 0-3 (not measured: 2-3)"
    )


def test_gate_host_smoke_failed_without_reasons():
    unit = smoke_entry("resnet")
    unit["passed"] = False
    assert gate_host(host_result(smoke=[unit]))["failures"] == [
        "smoke resnet: failed without a recorded reason"
    ]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.update(schema=2), "schema 2 is not supported"),
        (lambda r: r.update(kind="after"), "'kind' is 'after'"),
        (lambda r: r.update(host=""), "'host' must be"),
        (lambda r: r.update(smoke={"server": "x"}), "'smoke' must be a list"),
        (lambda r: r.update(smoke=[{"p99": 1}]), "smoke[0] is not `shminfer smoke"),
        (lambda r: r.update(consistency=[{"ok": True}]), "consistency[0] needs"),
        (lambda r: r.update(cyclictest={"load": "x"}), "raw document under 'json'"),
    ],
)
def test_malformed_results_are_refused(mutate, message):
    result = host_result()
    mutate(result)
    with pytest.raises(PostcheckError, match=re.escape(message)):
        validate_result(result, "epyc1.json")


def test_optional_keys_default_to_empty():
    minimal = {"schema": 1, "host": "vm1", "kind": "baseline"}
    out = validate_result(minimal)
    assert out["smoke"] == [] and out["plan"] == {} and out["cyclictest"] is None
    assert gate_host(minimal) == {"passed": True, "verdict": "passed", "failures": []}


# --------------------------------------------------------------------------- filters


@pytest.fixture(scope="module")
def filters():
    from conftest import REPO

    spec = importlib.util.spec_from_file_location(
        "rtfleet_filter_plugin", REPO / "plugins" / "filter" / "rtfleet.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FilterModule().filters()


def test_filters_are_registered_and_call_postcheck(filters):
    doc = cyclictest_doc("hist50000-complete")
    assert filters["cyclictest"](json.dumps(doc)) == parse_cyclictest(doc)
    result = host_result()
    assert filters["postcheck_gate"](result) == gate_host(result)


def test_filters_raise_ansible_errors(filters):
    from ansible.errors import AnsibleFilterError

    with pytest.raises(AnsibleFilterError, match=r"rtfleet cyclictest: .*return code 1"):
        filters["cyclictest"]({**cyclictest_doc("hist200-overflow"), "return_code": 1})
    with pytest.raises(AnsibleFilterError, match=r"rtfleet post-check gate: .*schema"):
        filters["postcheck_gate"]({"host": "x"})


def test_a_starved_thread_is_named_not_a_json_error():
    # Real capture (tests/fixtures/cyclictest/README.md): CPU 1 held by a SCHED_FIFO 99
    # busy loop, so its thread never ran, and cyclictest wrote its average as "-nan".
    text = (CYCLICTEST / "starved-thread-nan.json").read_text()
    assert '"avg": -nan' in text
    with pytest.raises(PostcheckError, match=re.escape("thread 1 (CPU 1) ran 0 cycles")):
        parse_cyclictest(text)


# --------------------------------------------------------------------------- consistency


def _observed(boot, drift, dropin="/etc/kubernetes/x.conf"):
    return {"boot": boot, "drift": drift, "kubelet_dropin": dropin}


def _drift_document(tmp_path, plan, shown, reserved, threads=9):
    """What rtfleet-drift --check --json says of the units and kubelet: the guard's own
    checks (drift_units) run on ``shown`` (systemctl show per unit), a drop-in with
    ``reserved`` (None: no drop-in) and each unit's threads as /proc would list them."""
    from rtfleet.drift_units import check_kubelet, check_units

    dropin = "etc/kubernetes/x.conf"
    if reserved is not None:
        (tmp_path / dropin).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / dropin).write_text(json.dumps({"reservedSystemCPUs": reserved}))
    units = {}
    for group, text in zip(plan["runtime_groups"], shown):
        units["shminfer@%s.service" % group["name"]] = dict(
            line.split("=", 1) for line in text.splitlines() if "=" in line
        )
    return {
        "checks": {
            "units": check_units(plan, units, True),
            "unit_threads": {
                "status": "ok",
                "units": {
                    "shminfer@%s.service" % g["name"]: {
                        "processes": 2,
                        "threads": threads,
                        "outside": [],
                    }
                    for g in plan["runtime_groups"]
                },
            },
            "kubelet": check_kubelet(str(tmp_path), plan, "/" + dropin),
        }
    }


def _consistency_inputs(trees, shape="epyc-9634-2s"):
    from rtfleet.cpulist import format_cpulist
    from rtfleet.planner import plan_partition
    from rtfleet.topology import read_topology

    plan = plan_partition(read_topology(str(trees(shape))), {})
    # systemctl prints a cpuset space-separated ("1-6 85-90").
    shown = [
        "CPUAffinity=%s\nNUMAPolicy=bind\nNUMAMask=%s\nMainPID=%d\nActiveState=active\n"
        % (
            format_cpulist(g["cpus"]).replace(",", " "),
            g.get("memory_node", g["numa_node"]),
            4000 + i,
        )
        for i, g in enumerate(plan["runtime_groups"])
    ]
    boot = {"mismatches": [], "running": {"release": "6.1.0-28-rt-amd64"}}
    return plan, boot, plan["kubelet"]["reservedSystemCPUs"], shown


@pytest.mark.parametrize(
    "shape", ["epyc-9634-2s", "epyc-9354-2s-nps4-cxl", "xeon-2s-memoryless-node0", "xeon-2s-smt"]
)
def test_consistency_passes_when_kernel_kubelet_and_units_say_what_the_plan_says(
    tmp_path, trees, shape
):
    from rtfleet.postcheck_consistency import consistency_checks

    plan, boot, reserved, shown = _consistency_inputs(trees, shape)
    assert len(plan["runtime_groups"]) >= 2  # server shapes: one unit per L3 group
    drift = _drift_document(tmp_path, plan, shown, reserved)
    checks = consistency_checks(plan, _observed(boot, drift))
    assert len(checks) == 2 + 2 * len(plan["runtime_groups"])
    assert all(c["ok"] for c in checks), [c for c in checks if not c["ok"]]


def test_consistency_names_each_disagreement(tmp_path, trees):
    from rtfleet.postcheck_consistency import consistency_checks

    plan, boot, _reserved, shown = _consistency_inputs(trees)
    first, last = plan["runtime_groups"][0], plan["runtime_groups"][-1]
    shown[0] = shown[0].replace("NUMAPolicy=bind", "NUMAPolicy=default")
    shown[-1] = shown[-1].replace("ActiveState=active", "ActiveState=failed")
    drift = _drift_document(tmp_path, plan, shown, "0-3")
    drift["checks"]["unit_threads"]["units"]["shminfer@%s.service" % first["name"]]["outside"] = [
        {"comm": "ov-worker", "cpus_allowed": "0-191", "last_cpu": 0}
    ]
    boot["mismatches"] = ["cmdline lacks nohz_full=1-3"]
    checks = consistency_checks(plan, _observed(boot, drift))
    failed = {c["check"]: c["detail"] for c in checks if not c["ok"]}
    assert failed == {
        "running kernel and /proc/cmdline = host record": "cmdline lacks nohz_full=1-3",
        "kubelet reservedSystemCPUs = plan": "kubelet 0-3, plan %s"
        % plan["kubelet"]["reservedSystemCPUs"],
        "shminfer@%s CPUAffinity/NUMA = plan" % first["name"]: failed.get(
            "shminfer@%s CPUAffinity/NUMA = plan" % first["name"]
        ),
        "shminfer@%s threads inside %s" % (first["name"], first["cpulist"]): (
            "9 threads of 2 processes, outside: ov-worker (allowed 0-191, last ran on 0)"
        ),
        "shminfer@%s CPUAffinity/NUMA = plan" % last["name"]: failed.get(
            "shminfer@%s CPUAffinity/NUMA = plan" % last["name"]
        ),
    }
    assert "NUMA default:" in failed["shminfer@%s CPUAffinity/NUMA = plan" % first["name"]]
    assert failed["shminfer@%s CPUAffinity/NUMA = plan" % last["name"]].startswith("failed,")


def test_consistency_without_kubelet_dropin_or_threads_says_so(tmp_path, trees):
    from rtfleet.postcheck_consistency import consistency_checks

    plan, boot, _reserved, shown = _consistency_inputs(trees, "xeon-2s-smt")
    drift = _drift_document(tmp_path, plan, shown, None, threads=0)
    checks = consistency_checks(plan, _observed(boot, drift))
    kubelet = next(c for c in checks if c["check"].startswith("kubelet"))
    assert kubelet["ok"] and "skipped: no /etc/kubernetes/x.conf" in kubelet["detail"]
    threads = [c for c in checks if "threads inside" in c["check"]]
    assert threads and not any(c["ok"] for c in threads)  # no thread seen is not a pass
    # A drift document without the unit checks (a guard of another version): no unit passes.
    checks = consistency_checks(plan, _observed(boot, {"checks": {}}))
    units = [c for c in checks if "CPUAffinity/NUMA" in c["check"] or "threads" in c["check"]]
    assert units and not any(c["ok"] for c in units)
    assert "the drift guard showed nothing of it" in units[0]["detail"]
    assert not next(c for c in checks if c["check"].startswith("kubelet"))["ok"]


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda p, d: ({**p, "runtime_groups": None}, d), "no runtime_groups"),
        (lambda p, d: (p, None), "no rtfleet-drift --check --json document"),
        (lambda p, d: (p, {"checks": []}), "no rtfleet-drift --check --json document"),
        (lambda p, d: (p, "{}"), "no rtfleet-drift --check --json document"),
    ],
)
def test_consistency_refuses_inputs_it_cannot_compare(tmp_path, trees, mangle, message):
    from rtfleet.postcheck import PostcheckError
    from rtfleet.postcheck_consistency import consistency_checks

    plan, boot, reserved, shown = _consistency_inputs(trees, "xeon-2s-smt")
    plan, drift = mangle(plan, _drift_document(tmp_path, plan, shown, reserved))
    with pytest.raises(PostcheckError, match=message):
        consistency_checks(plan, _observed(boot, drift))


@pytest.mark.parametrize(
    "junk", ["", "CPUAffinity\n", "=\n", "CPUAffinity=not-a-list\n", "\x00" * 9]
)
def test_consistency_reads_hostile_systemctl_output_as_a_failure(tmp_path, trees, junk):
    from rtfleet.postcheck_consistency import consistency_checks

    plan, boot, reserved, shown = _consistency_inputs(trees, "xeon-2s-smt")
    shown[0] = junk
    drift = _drift_document(tmp_path, plan, shown, reserved)
    checks = consistency_checks(plan, _observed(boot, drift))
    name = plan["runtime_groups"][0]["name"]
    (unit,) = [c for c in checks if c["check"] == "shminfer@%s CPUAffinity/NUMA = plan" % name]
    assert not unit["ok"]
    # The same systemctl output with an active unit but a CPUAffinity systemd cannot print.
    shown[0] = "ActiveState=active\nNUMAPolicy=bind\n" + junk
    drift = _drift_document(tmp_path, plan, shown, reserved)
    (unit,) = [
        c
        for c in consistency_checks(plan, _observed(boot, drift))
        if c["check"] == "shminfer@%s CPUAffinity/NUMA = plan" % name
    ]
    assert not unit["ok"]
