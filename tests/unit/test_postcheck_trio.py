"""hwlatdetect and oslat in the post-check: parsing real captures, the gates, the order.

oslat documents are real `oslat --json` files (tests/fixtures/oslat/README.md); hwlatdetect
outputs are real runs on a lab guest's PREEMPT_RT kernel (tests/fixtures/hwlatdetect/).
"""

from __future__ import annotations

import json
import re

import pytest
from postcheck_results import host_result, hwlatdetect_output, oslat_doc

from rtfleet.postcheck import PostcheckError, check_settings
from rtfleet.postcheck_gate import gate_host, gate_hwlatdetect, gate_oslat, hardware_gate
from rtfleet.postcheck_parse import parse_hwlatdetect, parse_oslat

# --------------------------------------------------------------------------- oslat


def test_oslat_capture_parses_per_cpu_with_its_open_last_bucket():
    parsed = parse_oslat(oslat_doc("cpus0-1-bucket8"))
    rows = {row["cpu"]: row for row in parsed["cpus"]}
    assert sorted(rows) == [0, 1]
    doc = oslat_doc("cpus0-1-bucket8")
    for thread in doc["thread"].values():
        row = rows[thread["cpu"]]
        assert row["loops"] == sum(thread["histogram"].values())
        assert row["max_us"] == thread["max"] and row["min_us"] == thread["min"]
        # -b 8: bucket 8 holds every gap of 8 us and more ("including overflows")
        assert row["bucket_us"] == 8 and row["overflows"] == thread["histogram"]["8"]
    summary = parsed["summary"]
    assert summary["max_us"] == 354113 and summary["max_cpu"] == 1
    assert summary["cpus"] == "0-1" and summary["bucket_us"] == 8
    assert summary["cmdline"].startswith("oslat -c 0-1")


def test_oslat_percentiles_by_rank_and_a_bound_in_the_last_bucket():
    doc = oslat_doc("cpus0-1-bucket8")
    thread = doc["thread"]["0"]
    thread["histogram"] = {"1": 990, "2": 9, "8": 1}
    row = parse_oslat(doc)["cpus"][0]
    assert row["p99_us"] == 1 and not row["p99_beyond_histogram"]
    # rank 999 of 1000 is the 999th loop: bucket 2
    assert row["p999_us"] == 2
    thread["histogram"] = {"1": 990, "2": 8, "8": 2}
    row = parse_oslat(doc)["cpus"][0]
    # rank 999 falls in the open bucket: >= 8 us, not a number
    assert row["p999_us"] is None and row["p999_beyond_histogram"]


def test_oslat_string_and_dict_agree():
    doc = oslat_doc("cpu1-rtprio")
    assert parse_oslat(json.dumps(doc)) == parse_oslat(doc)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("thread"), "this is not oslat --json output"),
        (lambda d: d.update(return_code=1), "oslat exited with return code 1"),
        (lambda d: d.update(thread={}), "no measurement threads"),
        (lambda d: d["thread"]["0"].pop("max"), "has no 'max'"),
        (lambda d: d["thread"]["0"].update(histogram={"1": 0, "32": 0}), "counted no loops"),
        (lambda d: d["thread"]["0"].update(histogram={"1": -5}), "negative count"),
        (lambda d: d["thread"]["0"].update(histogram={"x": 1}), "histogram bucket"),
    ],
)
def test_malformed_oslat_says_what_is_wrong(mutate, message):
    doc = oslat_doc("cpu1-rtprio")
    mutate(doc)
    with pytest.raises(PostcheckError, match=message):
        parse_oslat(doc)


@pytest.mark.parametrize("text", ["", "{", "[]"])
def test_oslat_not_a_document(text):
    with pytest.raises(PostcheckError, match="oslat"):
        parse_oslat(text)


def test_oslat_gate_names_value_limit_cpus_and_coverage():
    parsed = parse_oslat(oslat_doc("cpus0-1-bucket8"))
    assert gate_oslat(parsed, 354113, "0-1") == []
    (over,) = gate_oslat(parsed, 100000, "0-1")
    assert over == (
        "oslat max latency 354113 µs on CPU 1 exceeds the 100000 µs limit (1 of 2 CPUs over: "
        "CPU 1 354113 µs)"
    )
    (missing,) = gate_oslat(parsed, None, "0-3")
    assert "oslat measured CPUs 0-1 but the post-check asked for 0-3 (not measured: 2-3)" in missing


# --------------------------------------------------------------------------- gate_host


def test_tuned_host_needs_an_oslat_run_or_a_recorded_skip():
    failures = gate_host(host_result(oslat=None))["failures"]
    assert any(f.startswith("no oslat run recorded") for f in failures)
    assert gate_host(host_result(oslat="skipped"))["passed"]
    # a baseline may lack both
    assert gate_host(host_result(kind="baseline", oslat=None, hwlatdetect=None))["passed"]


def test_tuned_host_needs_a_hwlatdetect_run_or_a_recorded_skip():
    gate = gate_host(host_result(hwlatdetect=None))
    assert not gate["passed"] and gate["verdict"] == "failed"
    assert gate["failures"][0].startswith("no hwlatdetect run recorded")


def test_oslat_limit_defaults_to_the_cyclictest_limit():
    result = host_result(thresholds={"cyclictest_max_us": 400000, "cyclictest_min_cycles": 1})
    assert gate_host(result)["passed"]  # worst oslat gap 354113 us < 400000
    result["thresholds"]["oslat_max_us"] = 1000
    assert "exceeds the 1000 µs limit" in gate_host(result)["failures"][0]


# --------------------------------------------------------------------------- settings


def test_settings_are_checked_by_name_before_anything_runs():
    good = {
        "rtfleet_postcheck_hwlatdetect_duration": 300,
        "rtfleet_postcheck_duration": "300",
        "rtfleet_postcheck_oslat_duration": 300,
        "rtfleet_postcheck_long_run_s": 0,
        "rtfleet_postcheck_hwlatdetect_max_us": 20,
        "rtfleet_postcheck_hwlatdetect_window_us": 1000000,
        "rtfleet_postcheck_hwlatdetect_width_us": 500000,
        "rtfleet_postcheck_cyclictest_max_us": 100,
        "rtfleet_postcheck_cyclictest_p999_us": None,
        "rtfleet_postcheck_oslat_max_us": "100",
        "rtfleet_postcheck_oslat_priority": 0,
        "rtfleet_postcheck_oslat_bucket_size": 32,
        "rtfleet_postcheck_smoke_max_jitter": None,
    }
    assert check_settings(good) == []
    bad = dict(
        good,
        rtfleet_postcheck_oslat_duration=0,
        rtfleet_postcheck_hwlatdetect_max_us="20us",
        rtfleet_postcheck_oslat_priority=100,
        rtfleet_postcheck_hwlatdetect_width_us=1000000,
        rtfleet_postcheck_smoke_max_jitter=-0.1,
        rtfleet_postcheck_duration=None,
        rtfleet_postcheck_oslat_bucket_size=True,
    )
    errors = check_settings(bad)
    assert errors == [
        "rtfleet_postcheck_duration is empty: give a whole number of seconds",
        "rtfleet_postcheck_oslat_duration is 0: give a whole number of seconds, at least 1",
        "rtfleet_postcheck_hwlatdetect_max_us is '20us': give a whole number of microseconds",
        "rtfleet_postcheck_oslat_priority is 100: give a SCHED_FIFO priority, 0 to 99",
        "rtfleet_postcheck_oslat_bucket_size is True: give oslat's bucket count (--bucket-size)",
        "rtfleet_postcheck_smoke_max_jitter is -0.1: give a number (standard deviation / mean), "
        "at least 0",
        "rtfleet_postcheck_hwlatdetect_width_us (1000000) must be below "
        "rtfleet_postcheck_hwlatdetect_window_us (1000000): the tracer spins width µs of every "
        "window",
    ]
    assert check_settings(
        {
            "rtfleet_postcheck_hwlatdetect_max_us": 20,
            "rtfleet_postcheck_hwlatdetect_threshold_us": 30,
        }
    ) == [
        "rtfleet_postcheck_hwlatdetect_threshold_us (30) must not be above "
        "rtfleet_postcheck_hwlatdetect_max_us (20): a gap between the two would go unrecorded"
    ]
    assert check_settings({"rtfleet_postcheck_oslat_duraton": 3}) == [
        "rtfleet_postcheck_oslat_duraton is not a post-check setting this rtfleet knows"
    ]


# --------------------------------------------------------------------------- hwlatdetect


def test_hwlatdetect_capture_over_its_threshold():
    parsed = parse_hwlatdetect(hwlatdetect_output("rt-tcg-over-20us"))
    assert parsed["duration_s"] == 10 and parsed["threshold_us"] == 20
    assert parsed["window_us"] == 1000000 and parsed["width_us"] == 100000
    assert parsed["max_us"] == 35086 and parsed["exceeding"] == 10
    assert len(parsed["samples"]) == 10 and parsed["smis"] is None
    assert parsed["samples"][1] == {
        "ts": "1796167571.840253777",
        "inner_us": 11001,
        "outer_us": 35086,
    }
    (failure,) = gate_hwlatdetect(parsed, 20)
    assert failure.startswith(
        "hwlatdetect: hardware/firmware latency 35086 µs exceeds the 20 µs limit (10 samples "
        "over 10 s; no SMI counter on this CPU): no OS tuning removes this"
    )
    assert gate_hwlatdetect(parsed, 40000) == []


def test_hwlatdetect_below_threshold_is_a_pass():
    parsed = parse_hwlatdetect(hwlatdetect_output("rt-tcg-below-threshold"))
    assert parsed["max_us"] == 0 and parsed["samples"] == [] and parsed["exceeding"] == 0
    assert gate_hwlatdetect(parsed, 300000) == []
    # A limit below the threshold it ran with cannot be judged: a gap between the two
    # would not have been recorded.
    (failure,) = gate_hwlatdetect(parsed, 20)
    assert "ran with --threshold 300000 µs, above the 20 µs limit" in failure


def test_hwlatdetects_own_cpulist_above_cpu_31_is_explained():
    with pytest.raises(PostcheckError) as err:
        parse_hwlatdetect(hwlatdetect_output("rt-own-cpulist-above-31"))
    message = str(err.value)
    assert message.startswith("hwlatdetect did not finish: OSError: [Errno 75]")
    assert "CPU >= 32" in message and "32-bit comma groups" in message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "hwlatdetect did not finish: no output"),
        (
            "hwlatdetect:  test duration 10 seconds\nStarting test\n",
            "did not finish: Starting test",
        ),
        (
            "the running kernel 6.1.0-57-amd64 has no hwlat tracer (CONFIG_HWLAT_TRACER; "
            "available: nop)",
            "has no hwlat tracer",
        ),
        ("test finished\nMax Latency: lots\n", "max latency is 'lots'"),
        ("test finished\nMax Latency: 3us\nts: 1.0, inner:x, outer:2\n", "sample inner"),
        (b"\xff\xfe", "did not finish"),
    ],
)
def test_broken_hwlatdetect_output_says_what_is_wrong(text, message):
    with pytest.raises(PostcheckError, match=re.escape(message)):
        parse_hwlatdetect(text)


def test_failed_hwlatdetect_makes_the_host_hardware_and_the_rest_skipped():
    result = host_result(hwlatdetect="rt-tcg-over-20us", oslat="skipped", smoke=[])
    result["cyclictest"] = {"skipped": "hwlatdetect failed first"}
    gate = gate_host(result)
    assert gate["verdict"] == "hardware/firmware" and not gate["passed"]
    assert len(gate["failures"]) == 1  # the skipped tools add nothing
    assert gate["failures"][0].startswith("hwlatdetect: hardware/firmware latency 35086 µs")
    # the post-check's first look, before anything else ran, agrees
    parsed, failures = hardware_gate(result)
    assert parsed["max_us"] == 35086 and failures == gate["failures"]


def test_a_broken_hwlatdetect_run_fails_but_is_not_blamed_on_the_hardware():
    gate = gate_host(host_result(hwlatdetect="rt-own-cpulist-above-31"))
    assert gate["verdict"] == "failed"
    assert gate["failures"][0].startswith("hwlatdetect did not finish")
