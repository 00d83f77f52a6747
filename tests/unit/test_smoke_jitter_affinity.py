"""Issue 26 item 7: the smoke round trip's jitter coefficient is gated by default and shown,
and the smoke client's CPUs are the ones it ran on (its own affinity), not the ones it was
asked for. The client runs for real (the `shminfer smoke` CLI in a subprocess, pinned with
taskset or moved with sched_setaffinity) against a real server."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml
from conftest import REPO
from postcheck_results import host_result, smoke_entry, write_results
from shminfer_serving import CPUS, serving

from rtfleet.cpulist import parse_cpulist
from rtfleet.postcheck_gate import DEFAULT_SMOKE_MAX_JITTER, gate_host, gate_smoke
from rtfleet.report import build_report
from shminfer.client import attach

ROLE = REPO / "roles" / "rtfleet_postcheck"
# The thresholds the role records, without smoke_max_jitter: what a result gated by
# default looks like (host_result's own, generous for the captured cyclictest runs).
BASE_THRESHOLDS = host_result()["thresholds"]


def _smoke(*args, cpus=None, timeout=180):
    """`shminfer smoke` as the post-check runs it, optionally pinned with taskset."""
    argv = [sys.executable, "-m", "shminfer.cli", "smoke", "--format", "json", *args]
    if cpus is not None:
        argv = [shutil.which("taskset"), "--cpu-list", cpus, *argv]
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout)


_LOOSE = (
    "--max-p99-ms",
    "100000",
    "--max-deschedule-p999-ms",
    "100000",
    "--max-cpu-ratio",
    "100",
    "--max-slow-infer",
    "100000",
)


# ------------------------------------------------------------------ jitter, gated by default


def test_the_default_gate_fails_jitter_over_the_field_reports_bar():
    # 0.35: the field report's shared-core figure; 0.18: its pinned one.
    shared = host_result(smoke=[smoke_entry("ccx0", jitter=0.35)])
    assert "smoke_max_jitter" not in shared["thresholds"]
    gate = gate_host(shared)
    assert not gate["passed"]
    assert gate["failures"] == [
        "smoke ccx0: round-trip jitter (std/mean) 0.350 > 0.2 (rtfleet_postcheck_smoke_max_jitter)"
    ]
    assert gate_host(host_result(smoke=[smoke_entry("ccx0", jitter=0.18)]))["passed"]


def test_the_jitter_limit_is_the_inventorys_and_null_switches_it_off():
    entry = smoke_entry("ccx0", jitter=0.35)
    assert gate_smoke(entry, {"smoke_max_jitter": "0.5"}) == []
    assert gate_smoke(entry, {"smoke_max_jitter": None}) == []
    assert gate_smoke(smoke_entry("ccx0", jitter=0.12), {"smoke_max_jitter": 0.1}) == [
        "round-trip jitter (std/mean) 0.120 > 0.1 (rtfleet_postcheck_smoke_max_jitter)"
    ]
    # No figure to judge (fewer than two answers) fails like shminfer's own gate does.
    (missing,) = gate_smoke(smoke_entry("ccx0", jitter=None), {})
    assert missing.startswith("no round-trip jitter recorded")


def test_shminfers_own_jitter_failure_is_not_counted_twice():
    own = "round-trip jitter (std/mean) 0.350 > 0.2"
    entry = smoke_entry("ccx0", jitter=0.35, failures=[own])
    assert gate_smoke(entry, {}) == [own]


def test_the_role_gates_jitter_by_default_with_the_same_limit_everywhere():
    defaults = yaml.safe_load((ROLE / "defaults/main.yml").read_text())
    spec = yaml.safe_load((ROLE / "meta/argument_specs.yml").read_text())
    option = spec["argument_specs"]["main"]["options"]["rtfleet_postcheck_smoke_max_jitter"]
    assert defaults["rtfleet_postcheck_smoke_max_jitter"] == DEFAULT_SMOKE_MAX_JITTER == 0.2
    assert option["default"] == DEFAULT_SMOKE_MAX_JITTER
    # The threshold the role records is the one the gate reads.
    gate = (ROLE / "tasks/gate.yml").read_text()
    assert 'smoke_max_jitter: "{{ rtfleet_postcheck_smoke_max_jitter }}"' in gate


def test_the_report_has_a_jitter_column_and_fails_the_unit_over_the_bar(tmp_path):
    results = write_results(
        tmp_path / "r",
        [host_result("srv", smoke=[smoke_entry("ccx0", jitter=0.35), smoke_entry("ccx1")])],
    )
    build_report(results, tmp_path / "out", plots=False)
    markdown = (tmp_path / "out/report.md").read_text()
    page = (tmp_path / "out/report.html").read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| unit |"))
    assert "| max ms | jitter (std/mean) |" in header
    assert "<th>jitter (std/mean)</th>" in page
    rows = {
        line.split(" | ")[0]: line.split(" | ")
        for line in markdown.splitlines()
        if line.startswith(("| ccx0 ", "| ccx1 "))
    }
    column = header.split(" | ").index("jitter (std/mean)")
    assert rows["| ccx0"][column] == "0.350" and rows["| ccx1"][column] == "0.100"
    assert rows["| ccx0"][-1] == "no |" and rows["| ccx1"][-1] == "yes |"
    assert "<td>0.350</td>" in page
    assert "**Fleet: FAILED**" in markdown


# ------------------------------------------------------------------ where the client ran


@pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset (util-linux) is missing")
def test_the_smoke_client_records_the_cpus_it_ran_on():
    with serving() as server:
        pinned = _smoke("--name", server.name, "-n", "50", *_LOOSE, cpus=str(CPUS[0]))
        assert pinned.returncode == 0, pinned.stderr
        assert json.loads(pinned.stdout)["client_cpus"] == str(CPUS[0])
        # Unpinned: every CPU this process may use, as the kernel holds it.
        free = _smoke("--name", server.name, "-n", "50", *_LOOSE)
        assert free.returncode == 0, free.stderr
        recorded = parse_cpulist(json.loads(free.stdout)["client_cpus"])
        assert recorded == sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs: one asked for, another run on")
@pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset (util-linux) is missing")
def test_a_client_that_ran_elsewhere_than_asked_fails_the_gate_and_the_report_says_so(tmp_path):
    asked, ran = CPUS[-1], CPUS[0]
    with serving() as server:
        run = _smoke("--name", server.name, "-n", "50", *_LOOSE, cpus=str(ran))
    assert run.returncode == 0, run.stderr
    # What gate.yml records: shminfer's output plus the CPU the role pinned it to.
    entry = dict(json.loads(run.stdout), client_cpu=asked, client_cpu_from="pod_pool_same_node")
    entry["latency_jitter"] = 0.01  # this test is about placement, not this machine's noise
    result = host_result("srv", smoke=[entry])
    gate = gate_host(result)
    assert not gate["passed"]
    assert gate["failures"] == [
        "smoke %s: the client ran on CPUs %d, not on CPU %d where the post-check pinned it (the "
        "cgroup's cpuset or the affinity did not take): the round trip was not measured where "
        "the unit's samplers run" % (server.name, ran, asked)
    ]
    build_report(write_results(tmp_path / "r", [result]), tmp_path / "out", plots=False)
    markdown = (tmp_path / "out/report.md").read_text()
    assert "| %s | %d, asked for %d (pod pool, same node) |" % (server.name, ran, asked) in markdown
    # Where it ran as asked, the cell is the CPU it ran on, and the unit passes.
    entry["client_cpu"] = ran
    assert gate_host(host_result("srv", smoke=[entry]))["passed"]


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to move the client between")
@pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset (util-linux) is missing")
def test_a_client_moved_during_the_run_fails_with_both_affinities():
    first, second = CPUS[0], CPUS[1]
    warmup, requests = 5, 400
    with serving("sleep", "5") as server:
        # taskset execs the client: its pid is the client's.
        smoke = subprocess.Popen(
            [
                *(shutil.which("taskset"), "--cpu-list", str(first), sys.executable, "-m"),
                *("shminfer.cli", "smoke", "--name", server.name, "--format", "json"),
                *("--warmup", str(warmup), "-n", str(requests), *_LOOSE),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # Move it once the measured requests have begun: the worker's ring counts batches.
        sock, _answer, segments = attach(server.name, 0, 5.0)
        try:
            deadline = time.monotonic() + 120
            while sum(s.get("ring_head") for s in segments) < warmup + 20:
                assert smoke.poll() is None and time.monotonic() < deadline, smoke.stderr
                time.sleep(0.01)
            os.sched_setaffinity(smoke.pid, {second})
        finally:
            for segment in segments:
                segment.close()
            sock.close()
        out, err = smoke.communicate(timeout=180)
    assert smoke.returncode == 1, err
    result = json.loads(out)
    assert parse_cpulist(result["client_cpus"]) == [first, second]
    assert (
        "the client's CPU affinity changed during the run (CPUs %d, then %d)" % (first, second)
        in result["failures"]
    )
