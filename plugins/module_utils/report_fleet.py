"""The fleet document (fleet.json): every host's result read, parsed and re-gated.

:func:`load_results` reads the per-host ``*.json`` files the post-check role wrote (schema in
``postcheck.py``); :func:`evaluate_fleet` parses each host's tool output
(``postcheck_parse.py``), gates it again with ``postcheck_gate.gate_host``, compares the
worst baseline host with the worst tuned one (:func:`before_after`) and gives the fleet's
verdict. The report's tables, plots and pages (report.py) are drawn from this document.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from .postcheck import PostcheckError, load_result
from .postcheck_gate import gate_host
from .postcheck_parse import parse_cyclictest, parse_hwlatdetect, parse_oslat
from .report_files import ReportError

FLEET_SCHEMA_VERSION = 1

# Fleet-level rows of the before/after table: (label, unit, where the number lives).
# Every row is "lower is better", so the worst host of a kind is the one with the maximum.
_COMPARED = (
    ("cyclictest max", "µs", ("cyclictest", "max_us")),
    ("cyclictest p99.9", "µs", ("cyclictest", "p999_us")),
    ("smoke round trip p99", "ms", ("smoke", "latency_ms_p99")),
    ("smoke round trip p99.9", "ms", ("smoke", "latency_ms_p999")),
    ("deschedule p99.9", "ms", ("smoke", "deschedule_ms_p999")),
    ("process/thread CPU ratio", "", ("smoke", "cpu_ratio")),
    ("smoke round-trip jitter (std/mean)", "", ("smoke", "latency_jitter")),
)


def _evaluate(path, result):
    """One host's entry in fleet.json: the result with cyclictest parsed and the gate."""
    entry = {
        "host": result["host"],
        "kind": result["kind"],
        "source": str(path),
        "collected_at": result["collected_at"],
        "kernel": result["kernel"],
        "plan": result["plan"],
        "thresholds": result["thresholds"],
        "cyclictest": None,
        "smoke": result["smoke"],
        "consistency": result["consistency"],
    }
    raw = result["cyclictest"]
    if raw is not None:
        ct = {key: value for key, value in raw.items() if key != "json"}
        try:
            ct.update(parse_cyclictest(raw["json"]))
        except PostcheckError as exc:
            ct["error"] = str(exc)
        entry["cyclictest"] = ct
    entry["virtualization"] = result.get("virtualization")
    for tool, raw_key, parse in (
        ("hwlatdetect", "output", parse_hwlatdetect),
        ("oslat", "json", parse_oslat),
    ):
        raw = result.get(tool)
        if raw is None or "skipped" in raw:
            entry[tool] = raw
            continue
        parsed = {key: value for key, value in raw.items() if key != raw_key}
        try:
            parsed.update(parse(raw[raw_key]))
        except PostcheckError as exc:
            parsed["error"] = str(exc)
        entry[tool] = parsed
    gate = gate_host(result)
    entry["gate"] = gate
    recorded = result.get("gate")
    # The role gated on the host side with the same code; a difference means the file was
    # edited or written by another rtfleet version, which the reader should know.
    entry["gate_recorded_differs"] = bool(
        isinstance(recorded, dict)
        and (
            bool(recorded.get("passed")) != gate["passed"]
            or list(recorded.get("failures") or []) != gate["failures"]
        )
    )
    return entry


def load_results(results_dirs, skip=(), allow_empty=False):
    """[(path, validated result)] from every ``*.json`` in the directories, sorted.
    ``allow_empty``: no result is no error (hosts that stopped before their post-check)."""
    if isinstance(results_dirs, (str, os.PathLike)):
        results_dirs = [results_dirs]
    skip = {Path(p).resolve() for p in skip}
    loaded = []
    seen = {}
    for item in results_dirs:
        directory = Path(item)
        if not directory.is_dir():
            raise ReportError("%s: not a directory of post-check results" % directory)
        for path in sorted(directory.glob("*.json")):
            if path.resolve() in skip:
                continue
            try:
                result = load_result(path)
            except PostcheckError as exc:
                raise ReportError(str(exc)) from None
            key = (result["host"], result["kind"])
            if key in seen:
                raise ReportError(
                    "%s and %s both hold the %s result of %s: keep one"
                    % (seen[key], path, result["kind"], result["host"])
                )
            seen[key] = path
            loaded.append((path, result))
    if not loaded and not allow_empty:
        raise ReportError(
            "no post-check results (*.json) in %s: run playbooks that include the post-check "
            "first" % ", ".join(str(d) for d in results_dirs)
        )
    loaded.sort(key=lambda item: (item[1]["kind"] != "tuned", item[1]["host"]))
    return loaded


def _values(entry, where):
    """Every number of one compared metric on one host: [(value, beyond_histogram)]."""
    section, key = where
    if section == "cyclictest":
        ct = entry["cyclictest"]
        if not ct or "summary" not in ct:
            return []
        summary = ct["summary"]
        beyond = bool(summary.get(key.replace("_us", "") + "_beyond_histogram"))
        if beyond:
            return [(summary["histogram_us"], True)]
        return [] if summary.get(key) is None else [(summary[key], False)]
    return [
        (float(unit[key]), False)
        for unit in entry["smoke"]
        if isinstance(unit.get(key), (int, float)) and not isinstance(unit.get(key), bool)
    ]


def _worst_of(entries, where):
    worst = None
    for entry in entries:
        for value, beyond in _values(entry, where):
            # A lower bound from beyond the histogram still beats any smaller number.
            if worst is None or (value, beyond) > (worst["value"], worst["beyond"]):
                worst = {"value": value, "beyond": beyond, "host": entry["host"]}
    return worst


def before_after(hosts):
    """Fleet-level before/after rows, or None without both baseline and tuned hosts."""
    baseline = [h for h in hosts if h["kind"] == "baseline"]
    tuned = [h for h in hosts if h["kind"] == "tuned"]
    if not baseline or not tuned:
        return None
    rows = []
    for label, unit, where in _COMPARED:
        before = _worst_of(baseline, where)
        after = _worst_of(tuned, where)
        ratio = None
        if (
            before
            and after
            and not before["beyond"]
            and not after["beyond"]
            and before["value"] > 0
        ):
            ratio = after["value"] / before["value"]
        rows.append(
            {"metric": label, "unit": unit, "baseline": before, "tuned": after, "ratio": ratio}
        )
    return rows


def evaluate_fleet(results, stopped=()):
    """The fleet.json document (without files) for [(path, result)] and the hosts whose
    migration stopped (report_stopped.load_stopped)."""
    hosts = [_evaluate(path, result) for path, result in results]
    tuned = [h for h in hosts if h["kind"] == "tuned"]
    failed = [h["host"] for h in tuned if not h["gate"]["passed"]]
    stopped_hosts = [e["host"] for e in stopped if e["host"] not in failed]
    reasons = []
    if failed:
        reasons.append(
            "%d of %d tuned host(s) failed: %s" % (len(failed), len(tuned), ", ".join(failed))
        )
    if stopped_hosts:
        reasons.append(
            "%d host(s) stopped in their migration: %s"
            % (len(stopped_hosts), ", ".join(stopped_hosts))
        )
    if not reasons:
        reasons.append(
            "all %d tuned host(s) passed" % len(tuned)
            if tuned
            else "no tuned host in the results: nothing has been shown to pass"
        )
    return {
        "schema": FLEET_SCHEMA_VERSION,
        "generated_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "verdict": {
            "passed": bool(tuned) and not failed and not stopped_hosts,
            "reason": "; ".join(reasons),
            "tuned": len(tuned),
            "baseline": len(hosts) - len(tuned),
            "failed_hosts": failed + stopped_hosts,
        },
        "hosts": hosts,
        "before_after": before_after(hosts),
    }


__all__ = ["FLEET_SCHEMA_VERSION", "before_after", "evaluate_fleet", "load_results"]
