"""The fleet report: every host's post-check result, its verdict, plots, before and after.

``build_report(results_dir, out_dir)`` reads the per-host ``*.json`` files the post-check
role wrote (schema in ``postcheck.py``), re-gates each host with ``postcheck_gate.gate_host`` and
writes (the HTML and the Markdown from one document, :func:`report_blocks`, through the
Jinja2 templates of ``report_doc.py``)::

    out_dir/fleet.json                         every host, parsed, plus the fleet verdict
    out_dir/report.md                          for a merge request or a ticket
    out_dir/report.html                        self-contained (inline CSS, no scripts)
    out_dir/plots/<host>-latency-histogram.png cyclictest histogram, a line per CPU
    out_dir/plots/<host>-cpu-max.png           worst latency per CPU against the limit
    out_dir/plots/<host>-smoke-latency.png     shminfer smoke round trip per unit

The fleet passes when there is at least one tuned host, every tuned host passed its gate
and no host stopped in its migration (``stopped/<host>.json``, report_stopped.py).
Baseline hosts (the old VMs, measured before migration) are never gated: they are
the "before" column of the before/after table.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import re
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from .postcheck import PostcheckError, load_result
from .postcheck_gate import (
    DEFAULT_HWLATDETECT_MAX_US,
    cyclictest_thresholds,
    gate_host,
    gate_smoke,
    smoke_client_placement,
)
from .postcheck_parse import format_percentile, parse_cyclictest, parse_hwlatdetect, parse_oslat
from . import report_doc as doc
from .report_containers import containers_blocks, containers_failed, load_containers
from .report_drift import drift_blocks, load_drift
from .report_refused import load_refused, refused_blocks
from .report_stopped import load_stopped, stopped_blocks

FLEET_SCHEMA_VERSION = 1
DEFAULT_MAX_US = 100

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


class ReportError(Exception):
    """Bad report input (no results, duplicate hosts) or a missing plotting library."""


# --------------------------------------------------------------------------- evaluation


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


# --------------------------------------------------------------------------- plots


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
        from matplotlib.figure import Figure  # noqa: PLC0415
    except ImportError as exc:
        raise ReportError(
            "the report's plots need matplotlib (%s): pip install 'rtfleet[report]', or run "
            "`make setup` for the pinned tool chain" % exc
        ) from None

    def figure(width=8.0, height=4.5):
        fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)  # Agg: files only, no display needed
        return fig

    return figure


def _safe_name(host):
    return re.sub(r"[^A-Za-z0-9._-]", "_", host)


def _limit(value):
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _max_limit(entry, tool="cyclictest"):
    """The gate's worst-case limit for ``tool`` (cyclictest or oslat), as gate_host uses it."""
    ct_limit = cyclictest_thresholds(entry["thresholds"]).get("max_us", DEFAULT_MAX_US)
    if tool == "oslat":
        return _limit(entry["thresholds"].get("oslat_max_us", ct_limit))
    return _limit(ct_limit)


# Per tool: the title, the histogram's end in the summary, and what a count is.
_HIST_TOOLS = {
    "cyclictest": ("cyclictest latency", "histogram_us", "cycles"),
    "oslat": ("oslat loop gaps", "bucket_us", "loops"),
}


def _cpu_name(row):
    return str(row["cpu"]) if row["cpu"] is not None else "t%d" % row["thread"]


def _plot_histogram(figure, entry, path, tool="cyclictest"):
    ct = entry[tool]
    title, end_key, counted = _HIST_TOOLS[tool]
    limit = _max_limit(entry, tool)
    fig = figure()
    ax = fig.add_subplot()
    import numpy as np  # noqa: PLC0415  (a dependency of rtfleet already)

    many = len(ct["cpus"]) > 16
    rows = [row for row in ct["cpus"] if row["histogram"]]
    top = max(latency for row in rows for latency, _count in row["histogram"]) + 1
    # Log-spaced buckets: a tuned host's few µs and a VM's tens of ms fit on one axis, and
    # sparse 1 µs buckets of the tail do not turn into a comb.
    edges = np.unique(np.geomspace(1, max(top, 10), 60).round())
    hist_us = ct["summary"][end_key]
    for row in rows:
        xs = np.clip([latency for latency, _count in row["histogram"]], 1, None)
        ys = [count for _latency, count in row["histogram"]]
        counts = np.histogram(xs, bins=edges, weights=ys)[0]
        label = None
        if not many:
            label = "CPU %s" % _cpu_name(row)
            if row["overflows"]:
                label += " (%d ≥ %d µs)" % (row["overflows"], hist_us)
        ax.stairs(counts, edges, linewidth=0.6 if many else 1.0, label=label)
    if limit is not None and limit <= edges[-1]:
        ax.axvline(limit, color="red", linestyle="--", linewidth=1, label="limit %g µs" % limit)
    if any(row["overflows"] for row in ct["cpus"]):
        ax.axvline(
            hist_us, color="grey", linestyle=":", linewidth=1, label="histogram end %d µs" % hist_us
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("latency (µs, log)")
    ax.set_ylabel("%s (log)" % counted)
    ax.set_title("%s: %s histogram" % (entry["host"], title))
    ax.grid(True, which="major", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # none with > 16 CPUs and the limit off the axis
        ax.legend(fontsize="small")
    fig.savefig(path)


def _plot_cpu_max(figure, entry, path, tool="cyclictest"):
    ct = entry[tool]
    limit = _max_limit(entry, tool)
    rows = ct["cpus"]
    fig = figure(max(6.0, min(20.0, 0.3 * len(rows) + 3)), 4.0)
    ax = fig.add_subplot()
    colors = [
        "tab:red" if limit is not None and row["max_us"] > limit else "tab:blue" for row in rows
    ]
    ax.bar([_cpu_name(r) for r in rows], [r["max_us"] for r in rows], color=colors)
    if limit is not None:
        ax.axhline(limit, color="red", linestyle="--", linewidth=1, label="limit %g µs" % limit)
        ax.legend(fontsize="small")
    ax.set_xlabel("CPU")
    ax.set_ylabel("max latency (µs)")
    ax.set_title("%s: %s worst case per CPU" % (entry["host"], tool))
    ax.grid(True, axis="y", alpha=0.3)
    fig.savefig(path)


def _plot_hwlat(figure, entry, path):
    hw = entry["hwlatdetect"]
    limit = _limit(entry["thresholds"].get("hwlatdetect_max_us", DEFAULT_HWLATDETECT_MAX_US))
    fig = figure(8.0, 3.5)
    ax = fig.add_subplot()
    samples = hw["samples"]
    ts = [float(sample["ts"]) for sample in samples]
    start = min(ts)
    ax.scatter([t - start for t in ts], [s["inner_us"] for s in samples], s=12, label="inner")
    ax.scatter([t - start for t in ts], [s["outer_us"] for s in samples], s=12, label="outer")
    if limit is not None:
        ax.axhline(limit, color="red", linestyle="--", linewidth=1, label="limit %g µs" % limit)
    ax.set_yscale("log")
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("gap (µs, log)")
    ax.set_title("%s: hwlatdetect samples above the threshold" % entry["host"])
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path)


def _plot_smoke(figure, entry, path):
    units = entry["smoke"]
    fig = figure(max(6.0, min(20.0, 1.2 * len(units) + 3)), 4.0)
    ax = fig.add_subplot()
    stats = (("p50", "latency_ms_p50"), ("p99", "latency_ms_p99"), ("p99.9", "latency_ms_p999"))
    stats += (("max", "latency_ms_max"),)
    width = 0.8 / len(stats)
    for i, (label, key) in enumerate(stats):
        xs = [u + (i - (len(stats) - 1) / 2) * width for u in range(len(units))]
        ys = [float(unit.get(key) or 0.0) for unit in units]
        ax.bar(xs, ys, width=width, label=label)
    ax.set_xticks(range(len(units)))
    ax.set_xticklabels([str(unit.get("server")) for unit in units])
    ax.set_ylabel("round trip (ms)")
    ax.set_title("%s: shminfer smoke round trip per unit" % entry["host"])
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path)


def write_plots(hosts, plots_dir):
    """PNG plots per host into plots_dir; each host entry gets {"plots": {name: path}}."""
    figure = _matplotlib()
    plots_dir = Path(plots_dir)
    plots_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for entry in hosts:
        entry["plots"] = {}
        base = _safe_name(entry["host"]) + ("-baseline" if entry["kind"] == "baseline" else "")
        ct = entry["cyclictest"]
        jobs = []
        if ct and "cpus" in ct:
            if any(row["histogram"] for row in ct["cpus"]):
                jobs.append(("latency_histogram", "latency-histogram", _plot_histogram))
            jobs.append(("cpu_max", "cpu-max", _plot_cpu_max))
        hw = entry.get("hwlatdetect")
        if hw and hw.get("samples"):
            jobs.append(("hwlat_samples", "hwlat-samples", _plot_hwlat))
        osl = entry.get("oslat")
        if osl and "cpus" in osl:
            jobs.append(
                ("oslat_histogram", "oslat-histogram", partial(_plot_histogram, tool="oslat"))
            )
            jobs.append(("oslat_cpu_max", "oslat-cpu-max", partial(_plot_cpu_max, tool="oslat")))
        if entry["smoke"]:
            jobs.append(("smoke_latency", "smoke-latency", _plot_smoke))
        for key, suffix, plot in jobs:
            path = plots_dir / ("%s-%s.png" % (base, suffix))
            with _replacing(path) as tmp:
                plot(figure, entry, tmp)
            entry["plots"][key] = "%s/%s" % (plots_dir.name, path.name)
            written.append(path)
    return written


# --------------------------------------------------------------------------- rendering


def _fmt(value, digits=3):
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return "%.*f" % (digits, value)
    return str(value)


def _cell(worst, unit):
    if worst is None:
        return "n/a"
    if worst["beyond"]:
        text = "≥ %g" % worst["value"]
    elif unit == "µs":
        text = "%g" % worst["value"]
    else:
        text = "%.3f" % worst["value"]
    return "%s (%s)" % (text, worst["host"])


def _ratio(value):
    return "n/a" if value is None else "%.3g" % value


def host_summary(entry):
    """One fleet-table row for a host, as strings."""
    ct = entry["cyclictest"] or {}
    summary = ct.get("summary") or {}
    smoke = entry["smoke"]
    passed_units = sum(1 for unit in smoke if not gate_smoke(unit, entry["thresholds"]))
    kernel = entry["kernel"] or {}
    rt = kernel.get("realtime")
    if rt is None and summary:
        rt = summary.get("realtime")
    if entry["kind"] == "baseline":
        verdict = "baseline"
    else:
        verdict = "PASS" if entry["gate"]["passed"] else "FAIL"
    return {
        "host": entry["host"],
        "kind": entry["kind"],
        "kernel": "%s%s"
        % (
            kernel.get("release") or summary.get("kernel_release") or "?",
            " (RT)" if rt else "",
        ),
        "ct_max_us": _fmt(summary.get("max_us")) if summary else ("error" if ct else "-"),
        "ct_p999_us": format_percentile(summary, "p999") if summary else "-",
        "smoke": "%d/%d passed" % (passed_units, len(smoke)) if smoke else "-",
        "verdict": verdict,
    }


_FLEET_COLUMNS = (
    ("host", "host"),
    ("kind", "kind"),
    ("kernel", "kernel"),
    ("cyclictest max µs", "ct_max_us"),
    ("cyclictest p99.9 µs", "ct_p999_us"),
    ("smoke units", "smoke"),
    ("verdict", "verdict"),
)

_CPU_COLUMNS = ("CPU", "node", "cycles", "min µs", "avg µs", "max µs", "p99 µs", "p99.9 µs")
_CPU_COLUMNS += ("overflows",)


def _cpu_cells(row, hist_us):
    return [
        _cpu_name(row),
        _fmt(row["node"]),
        str(row["cycles"]),
        str(row["min_us"]),
        "%.2f" % row["avg_us"],
        str(row["max_us"]),
        format_percentile(row, "p99", hist_us),
        format_percentile(row, "p999", hist_us),
        _fmt(row["overflows"]),
    ]


_SMOKE_COLUMNS = ("unit", "client CPU", "requests", "errors", "p50 ms", "p99 ms", "p99.9 ms")
_SMOKE_COLUMNS += ("max ms", "jitter (std/mean)")
_SMOKE_COLUMNS += ("deschedule p99.9 ms", "CPU ratio", "slow_infer", "passed")


def _ms(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "n/a"
    return "%.3f" % value


def _client_cell(unit):
    """Where the smoke client ran: its affinity as it ran (``client_cpus``, recorded by the
    client itself), and the CPU the post-check pinned it to (where the unit's samplers go)
    when that was another."""
    ran, asked = unit.get("client_cpus"), unit.get("client_cpu")
    if asked is None:
        return "CPUs %s (not pinned)" % ran if ran is not None else "not pinned"
    where = {
        "pod_pool_same_node": "pod pool, same node",
        "pod_pool_same_package": "pod pool, same socket",
        "housekeeping_same_node": "housekeeping, same node",
    }.get(unit.get("client_cpu_from"), unit.get("client_cpu_from") or "?")
    if ran is None:
        return "%s (%s; as it ran: not recorded)" % (asked, where)
    if smoke_client_placement(unit):
        return "%s, asked for %s (%s)" % (ran, asked, where)
    return "%s (%s)" % (ran, where)


def _smoke_cells(unit, thresholds=None):
    return [
        str(unit.get("server")),
        _client_cell(unit),
        _fmt(unit.get("requests")),
        _fmt(unit.get("errors")),
        _ms(unit.get("latency_ms_p50")),
        _ms(unit.get("latency_ms_p99")),
        _ms(unit.get("latency_ms_p999")),
        _ms(unit.get("latency_ms_max")),
        _ms(unit.get("latency_jitter")),
        _ms(unit.get("deschedule_ms_p999")),
        _ms(unit.get("cpu_ratio")),
        _fmt(unit.get("slow_infer")),
        "no" if gate_smoke(unit, thresholds) else "yes",
    ]


def _before_after_cells(row):
    unit = " (%s)" % row["unit"] if row["unit"] else ""
    return [
        row["metric"] + unit,
        _cell(row["baseline"], row["unit"]),
        _cell(row["tuned"], row["unit"]),
        _ratio(row["ratio"]),
    ]


_BEFORE_AFTER_COLUMNS = (
    "metric",
    "baseline (worst host)",
    "tuned (worst host)",
    "tuned ÷ baseline",
)


def _plan_text(plan):
    if not plan:
        return "-"
    parts = ["housekeeping %s" % plan.get("housekeeping", "?")]
    parts.append("isolated %s" % plan.get("isolated", "?"))
    groups = plan.get("runtime_groups") or {}
    if groups:
        parts.append("groups " + ", ".join("%s=%s" % kv for kv in sorted(groups.items())))
    return "; ".join(parts)


_OSLAT_COLUMNS = ("CPU", "loops", "min µs", "avg µs", "max µs", "p99 µs", "p99.9 µs")
_OSLAT_COLUMNS += ("≥ last bucket",)
_HWLAT_COLUMNS = ("seconds in", "inner µs", "outer µs")


def _oslat_cells(row):
    bucket = row["bucket_us"]
    return [
        _cpu_name(row),
        str(row["loops"]),
        str(row["min_us"]),
        "%.3f" % row["avg_us"],
        str(row["max_us"]),
        format_percentile(row, "p99", bucket),
        format_percentile(row, "p999", bucket),
        str(row["overflows"]),
    ]


def _emulation_note(entry):
    """A warning sentence when the figures were taken in an emulator or a VM, else None."""
    virt = entry.get("virtualization")
    if not virt or virt == "none":
        return None
    if virt == "qemu":
        return (
            "EMULATED CPU (QEMU TCG, no hardware virtualisation): every figure of this host "
            "measures an emulator sharing a few host cores. It says nothing about hardware, "
            "only that the flow ran."
        )
    return (
        "Virtual machine (%s): hwlatdetect measures the hypervisor's stalls, and every "
        "latency includes the host's scheduling of this VM." % virt
    )


def _tool_blocks(entry):
    """[(title, sentence, (header, rows) or None)] for hwlatdetect and oslat, in run order."""
    blocks = []
    hw = entry.get("hwlatdetect")
    limit = entry["thresholds"].get("hwlatdetect_max_us", DEFAULT_HWLATDETECT_MAX_US)
    if hw is not None:
        if "skipped" in hw:
            blocks.append(("hwlatdetect", "Not run: %s." % hw["skipped"].rstrip("."), None))
        elif "error" in hw:
            blocks.append(("hwlatdetect", "Unreadable: %s" % hw["error"], None))
        else:
            sentence = (
                "%s s on CPUs %s, threshold %s µs (limit %s µs), width %s of every %s µs: "
                % (
                    _fmt(hw.get("duration_s")),
                    hw.get("cpus") or "?",
                    _fmt(hw.get("threshold_us")),
                    _fmt(limit),
                    _fmt(hw.get("width_us")),
                    _fmt(hw.get("window_us")),
                )
            )
            if hw["samples"]:
                sentence += "%d samples above the threshold, worst %d µs%s." % (
                    len(hw["samples"]),
                    hw["max_us"],
                    "" if hw.get("smis") is None else ", %d SMIs" % hw["smis"],
                )
            else:
                sentence += "no gap above the threshold."
            table = None
            if hw["samples"]:
                start = min(float(x["ts"]) for x in hw["samples"])
                worst = sorted(hw["samples"], key=lambda x: -max(x["inner_us"], x["outer_us"]))
                table = (
                    _HWLAT_COLUMNS,
                    [
                        ["%.3f" % (float(x["ts"]) - start), str(x["inner_us"]), str(x["outer_us"])]
                        for x in worst[:20]
                    ],
                )
            blocks.append(("hwlatdetect", sentence, table))
    osl = entry.get("oslat")
    if osl is not None:
        if "skipped" in osl:
            blocks.append(("oslat", "Not run: %s." % osl["skipped"].rstrip("."), None))
        elif "error" in osl:
            blocks.append(("oslat", "Unreadable: %s" % osl["error"], None))
        else:
            summary = osl["summary"]
            sentence = "rt-tests %s, %s s on CPUs %s at %s, load: %s, 1 µs buckets to %d µs." % (
                summary["version"],
                _fmt(summary["duration_s"]),
                summary["cpus"],
                "SCHED_FIFO %s" % osl["priority"] if osl.get("priority") else "SCHED_OTHER",
                osl.get("load") or "none recorded",
                summary["bucket_us"],
            )
            blocks.append(
                ("oslat", sentence, (_OSLAT_COLUMNS, [_oslat_cells(r) for r in osl["cpus"]]))
            )
    return blocks


_PLOTS = (
    ("hwlat_samples", "hwlatdetect samples"),
    ("latency_histogram", "cyclictest latency histogram"),
    ("cpu_max", "cyclictest max latency per CPU"),
    ("oslat_histogram", "oslat histogram"),
    ("oslat_cpu_max", "oslat max latency per CPU"),
    ("smoke_latency", "smoke round trip"),
)


def report_blocks(fleet):
    """The whole report as report_doc blocks: one document for report.html and report.md."""
    verdict = fleet["verdict"]
    passed = verdict["passed"]
    out = [
        doc.heading(1, "rtfleet post-check report"),
        doc.para(
            doc.span(
                "Fleet: %s" % ("PASSED" if passed else "FAILED"), "pass" if passed else "fail"
            ),
            " (%s). " % verdict["reason"],
            doc.span("Generated %s." % fleet["generated_at"], "muted"),
        ),
        doc.heading(2, "Hosts"),
    ]
    rows = [host_summary(h) for h in fleet["hosts"]]
    out.append(
        doc.table(
            [c for c, _key in _FLEET_COLUMNS],
            [[r[k] for _title, k in _FLEET_COLUMNS] for r in rows],
            "fleet",
        )
    )
    if fleet["before_after"]:
        out += [
            doc.heading(2, "Before and after"),
            doc.para(
                "Worst host of each kind; baseline = the old VMs before migration. Lower is "
                "better; ≥ N means beyond cyclictest's histogram (no ratio)."
            ),
            doc.table(
                _BEFORE_AFTER_COLUMNS,
                [_before_after_cells(r) for r in fleet["before_after"]],
                "before-after",
            ),
        ]
    out.extend(stopped_blocks(fleet.get("stopped")))
    out.extend(containers_blocks(fleet.get("containers")))
    out.extend(refused_blocks(fleet.get("refused")))
    out.extend(drift_blocks(fleet.get("drift")))
    for entry in fleet["hosts"]:
        out.extend(_host_blocks(entry))
    return out


def render_markdown(fleet):
    return doc.render_markdown(report_blocks(fleet))


def render_html(fleet):
    return doc.render_html(report_blocks(fleet), "rtfleet post-check report", _CSS)


def _host_facts(entry):
    kernel = entry["kernel"] or {}
    facts = [
        doc.item("collected: %s" % (entry["collected_at"] or "?")),
        doc.item(
            "kernel: %s, realtime %s" % (kernel.get("release", "?"), kernel.get("realtime", "?"))
        ),
        doc.item("plan: %s" % _plan_text(entry["plan"])),
    ]
    if kernel.get("cmdline"):
        facts.append(doc.item("cmdline: ", doc.span(kernel["cmdline"], code=True)))
    if entry["kind"] == "tuned":
        gate = entry["gate"]
        shown = (
            doc.span("passed", "pass")
            if gate["passed"]
            else doc.span("failed (%s)" % gate.get("verdict", "failed"), "fail")
        )
        facts.append(doc.item("gate: ", shown, children=[[f] for f in gate["failures"]]))
    if entry["gate_recorded_differs"]:
        facts.append(
            doc.item("note: the gate recorded in the result file differs from this evaluation")
        )
    return facts


def _tool_section(title, sentence, table):
    out = [doc.heading(3, title), doc.para(sentence)]
    if table:
        out.append(doc.table(*table, title))
    return out


def _host_blocks(entry):
    out = [
        doc.heading(
            2,
            "%s (%s)" % (entry["host"], entry["kind"]),
            anchor="host-%s" % _safe_name(entry["host"]),
        )
    ]
    emulated = _emulation_note(entry)
    if emulated:
        out.append(doc.note(emulated))
    out.append(doc.bullets(_host_facts(entry)))
    blocks = _tool_blocks(entry)
    for block in blocks[:1]:
        out.extend(_tool_section(*block))
    ct = entry["cyclictest"]
    if ct and "skipped" in ct:
        out += [doc.heading(3, "cyclictest"), doc.para("Not run: %s." % ct["skipped"].rstrip("."))]
    elif ct:
        out.append(doc.heading(3, "cyclictest"))
        if "error" in ct:
            out.append(doc.para("Unreadable: %s" % ct["error"]))
        else:
            summary = ct["summary"]
            hist_us = summary["histogram_us"]
            out += [
                doc.para(
                    "rt-tests %s, %d cycles on CPUs %s, load: %s, histogram %s µs."
                    % (
                        summary["version"],
                        summary["cycles"],
                        summary["cpus"] or "?",
                        ct.get("load") or "none recorded",
                        _fmt(hist_us),
                    )
                ),
                doc.table(_CPU_COLUMNS, [_cpu_cells(r, hist_us) for r in ct["cpus"]], "cpus"),
            ]
    for block in blocks[1:]:
        out.extend(_tool_section(*block))
    if entry["smoke"]:
        out += [
            doc.heading(3, "shminfer smoke"),
            doc.table(
                _SMOKE_COLUMNS,
                [_smoke_cells(u, entry["thresholds"]) for u in entry["smoke"]],
                "smoke",
            ),
        ]
    if entry["consistency"]:
        out += [
            doc.heading(3, "Consistency checks"),
            doc.table(
                ("check", "ok", "detail"),
                [
                    (c.get("check"), "yes" if c.get("ok") else "no", c.get("detail", ""))
                    for c in entry["consistency"]
                ],
                "consistency",
            ),
        ]
    for key, title in _PLOTS:
        src = entry.get("plots", {}).get(key)
        if src:
            out.append(doc.image(src, "%s %s" % (entry["host"], title)))
    return out


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em;color:#222;max-width:1200px}
table{border-collapse:collapse;margin:0.5em 0 1.2em}
th,td{border:1px solid #ccc;padding:0.25em 0.6em;text-align:right}
th{background:#f0f0f0}td:first-child,th:first-child{text-align:left}
.pass{color:#166534;font-weight:bold}.fail{color:#b91c1c;font-weight:bold}
.muted{color:#666}img{max-width:100%;border:1px solid #ddd;margin:0.3em 0}
code{background:#f5f5f5;padding:0 0.2em}
"""


def render_fleet_table(fleet, console=None):
    """The short fleet table for a terminal, drawn with rich."""
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    # Piped output (CI logs) gets room for the failure lines, like rtfleet.render.
    console = console or Console(
        highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 150
    )
    table = Table(title="rtfleet post-check", title_justify="left")
    for title in ("host", "kind", "kernel"):
        table.add_column(title)
    for title in ("max µs", "p99.9 µs", "smoke units", "verdict"):
        table.add_column(title, justify="right")
    for entry in fleet["hosts"]:
        row = host_summary(entry)
        verdict = row["verdict"]
        style = {"PASS": "[green]PASS[/]", "FAIL": "[bold red]FAIL[/]"}.get(verdict, verdict)
        table.add_row(*[row[k] for _title, k in _FLEET_COLUMNS[:-1]], style)
    console.print(table)
    for entry in fleet["hosts"]:
        if entry["kind"] == "tuned" and not entry["gate"]["passed"]:
            console.print("[bold]%s[/]:" % entry["host"])
            for failure in entry["gate"]["failures"]:
                console.print("  - %s" % failure, markup=False)
    verdict = fleet["verdict"]
    console.print(
        ("[green]fleet PASSED[/]: " if verdict["passed"] else "[bold red]fleet FAILED[/]: ")
        + verdict["reason"]
    )


# --------------------------------------------------------------------------- entry point


@contextlib.contextmanager
def _replacing(path):
    """Yield a temporary path beside ``path``; it replaces ``path`` only when complete, so a
    reader (or a browser) never sees half a file."""
    # matplotlib picks the format from the suffix; nothing else may look like a result file
    suffix = ".png" if path.suffix == ".png" else ".part"
    fd, tmp = tempfile.mkstemp(prefix=".%s." % path.name, suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@contextlib.contextmanager
def _report_lock(out_dir, timeout_s=300.0):
    """One writer of a report directory at a time: several failing hosts of a batch (the
    rollout's rescue path) or two playbooks may build the report at once."""
    with open(out_dir / ".report.lock", "a") as fh:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ReportError(
                        "%s is locked by another report writer for %ds" % (out_dir, timeout_s)
                    ) from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _write_text(path, text):
    with _replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def build_report(results_dir, out_dir, plots=True):
    """Read every per-host result, write fleet.json, report.md, report.html and plots/.

    ``results_dir`` is a directory or a list of them (e.g. tuned and baseline results
    kept apart). Returns the fleet document, with ``files`` naming what was written
    (paths relative to ``out_dir``). Raises :class:`ReportError` on bad input.
    """
    out_dir = Path(out_dir)
    fleet_json = out_dir / "fleet.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    with _report_lock(out_dir):
        dirs = [results_dir] if isinstance(results_dir, (str, os.PathLike)) else list(results_dir)
        # playbooks/rollout.yml's rescue: <results>/stopped/*.json, a host's failed step.
        stopped = load_stopped(d for d in dirs if Path(d).is_dir())
        results = load_results(results_dir, skip=[fleet_json], allow_empty=bool(stopped))
        fleet = evaluate_fleet(results, stopped)
        fleet["stopped"] = stopped
        fleet["results"] = [str(d) for d in dirs]
        fleet["drift"] = load_drift(dirs)  # playbooks/verify.yml: <results>/drift/*.json
        fleet["refused"] = load_refused(dirs)  # playbooks/assess.yml: <results>/refused/*.json
        # playbooks/samplers.yml: <results>/containers/*.json; a sampler pod that missed its
        # own node's unit or broke a smoke gate fails the fleet like a host would.
        fleet["containers"] = load_containers(dirs)
        failed = containers_failed(fleet["containers"])
        if failed:
            verdict = fleet["verdict"]
            verdict["passed"] = False
            verdict["reason"] = "; ".join([verdict["reason"], *failed])
        written = write_plots(fleet["hosts"], out_dir / "plots") if plots else []
        fleet["files"] = {
            "json": "fleet.json",
            "markdown": "report.md",
            "html": "report.html",
            "plots": ["plots/%s" % p.name for p in written],
        }
        _write_text(out_dir / "report.md", render_markdown(fleet))
        _write_text(out_dir / "report.html", render_html(fleet))
        _write_text(fleet_json, json.dumps(fleet, indent=2, ensure_ascii=False) + "\n")
    return fleet


__all__ = [
    "ReportError",
    "before_after",
    "build_report",
    "evaluate_fleet",
    "host_summary",
    "load_results",
    "render_fleet_table",
    "render_html",
    "render_markdown",
    "write_plots",
]
