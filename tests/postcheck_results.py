"""Per-host post-check results for tests, built from real cyclictest captures.

The cyclictest documents are files captured on a real machine
(tests/fixtures/cyclictest/README.md); the smoke entries go through shminfer's own
``summarize`` so their keys are the ones ``shminfer smoke --format json`` prints.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np

from shminfer.metrics import summarize
from shminfer.queue import RING_FIELDS

CYCLICTEST = Path(__file__).resolve().parent / "fixtures" / "cyclictest"
OSLAT = Path(__file__).resolve().parent / "fixtures" / "oslat"
HWLATDETECT = Path(__file__).resolve().parent / "fixtures" / "hwlatdetect"


def cyclictest_doc(name: str) -> dict:
    """A captured ``cyclictest --json`` document (fresh copy), e.g. "hist200-overflow"."""
    return json.loads((CYCLICTEST / f"{name}.json").read_text(encoding="utf-8"))


def oslat_doc(name: str) -> dict:
    """A captured ``oslat --json`` document (fresh copy), e.g. "cpus0-1-bucket8"."""
    return json.loads((OSLAT / f"{name}.json").read_text(encoding="utf-8"))


def hwlatdetect_output(name: str) -> str:
    """A captured ``hwlatdetect`` standard output, e.g. "rt-below-threshold"."""
    return (HWLATDETECT / f"{name}.txt").read_text(encoding="utf-8")


def smoke_entry(
    server: str,
    *,
    latency_ms: tuple = (0.4, 0.9, 1.2, 1.5),
    wall_ms: float = 0.3,
    deschedule_ms: float = 0.0,
    thread_share: float = 1.0,
    jitter: float | None = 0.1,
    failures: list | None = None,
) -> dict:
    """`shminfer smoke --format json` output for one unit, shaped like cmd_smoke builds it."""
    batches = 100
    col = {name: np.zeros(batches) for name in RING_FIELDS}
    col["done_ns"] = np.arange(batches) * 1e6
    col["wall_ns"] = np.full(batches, (wall_ms + deschedule_ms) * 1e6)
    col["process_cpu_ns"] = np.full(batches, wall_ms * 1e6)
    col["thread_cpu_ns"] = col["process_cpu_ns"] * thread_share
    col["queue_wait_ns"] = np.full(batches, 0.05e6)
    col["batch"] = np.ones(batches)
    records = np.stack([col[name] for name in RING_FIELDS], axis=1)
    summary = summarize(records)
    failures = list(failures or [])
    p50, p99, p999, peak = latency_ms
    return {
        "server": server,
        "requests": 200,
        "errors": 0,
        "latency_ms_p50": p50,
        "latency_ms_p99": p99,
        "latency_ms_p999": p999,
        "latency_ms_max": peak,
        "latency_jitter": jitter,
        "slow_infer": 0,
        **{k: v for k, v in summary.items() if k != "samples"},
        "passed": not failures,
        "failures": failures,
    }


def host_result(
    host: str = "epyc1",
    *,
    kind: str = "tuned",
    cyclictest: str | None = "hist50000-complete",
    hwlatdetect: str | None = "skipped",
    oslat: str | None = "cpus0-1-bucket8",
    smoke: list | None = None,
    consistency: list | None = None,
    thresholds: dict | None = None,
) -> dict:
    """A schema-1 per-host result as the post-check role writes it.

    ``hwlatdetect``/``oslat``: a capture's name, "skipped" (recorded as not run, with a
    reason) or None (not recorded at all).
    """
    doc = cyclictest_doc(cyclictest) if cyclictest else None
    if hwlatdetect == "skipped":
        hwlat_entry = {"skipped": "the running kernel has no hwlat tracer (test)"}
    elif hwlatdetect:
        hwlat_entry = {"output": hwlatdetect_output(hwlatdetect), "cpus": "1", "duration_s": 10}
    else:
        hwlat_entry = None
    if oslat == "skipped":
        oslat_entry = {"skipped": "rtfleet_postcheck_oslat is false"}
    elif oslat:
        oslat_entry = {"json": oslat_doc(oslat), "cpus": "0-1", "duration_s": 3, "priority": 0}
    else:
        oslat_entry = None
    result = {
        "schema": 1,
        "host": host,
        "kind": kind,
        "collected_at": "2026-11-30T13:00:00Z",
        "kernel": {
            "release": doc["sysinfo"]["release"] if doc else "6.1.0-vmware",
            "realtime": False,
            "cmdline": "BOOT_IMAGE=/vmlinuz isolcpus=managed_irq,domain,1",
        },
        "plan": {}
        if kind == "baseline"
        else {"housekeeping": "0", "isolated": "1", "runtime_groups": {"ccx0": "1"}},
        "cyclictest": None
        if doc is None
        else {
            "json": doc,
            "load": "hackbench -g 2 -l 100000 (pinned to 0)",
            "duration_s": 3,
            "cpus": "0-1",
        },
        "hwlatdetect": hwlat_entry,
        "oslat": oslat_entry,
        "smoke": [smoke_entry("resnet")] if smoke is None else smoke,
        "consistency": [{"check": "isolated CPUs", "ok": True, "detail": "1 isolated"}]
        if consistency is None
        else consistency,
        # Generous enough for the captured runs (a busy 2-CPU VM) unless a test tightens it.
        "thresholds": {
            "cyclictest_max_us": 5000,
            "cyclictest_min_cycles": 1000,
            "oslat_max_us": 500000,
            "hwlatdetect_max_us": 20,
        }
        if thresholds is None
        else thresholds,
        "gate": None,
    }
    return copy.deepcopy(result)


def write_results(directory: Path, results: list) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for result in results:
        name = result["host"] + ("-baseline" if result["kind"] == "baseline" else "")
        (directory / f"{name}.json").write_text(json.dumps(result), encoding="utf-8")
    return directory
