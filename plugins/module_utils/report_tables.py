"""The report's tables: the cells of every table, as strings, and the terminal's fleet table.

Each ``*_table`` function returns ``(header, rows)`` for one table of the report (report.py
wraps them in report_doc blocks): the fleet's hosts (:func:`host_summary` per row), before
and after, a host's cyclictest and oslat CPUs, its hwlatdetect samples, its smoke units and
its consistency checks. :func:`render_fleet_table` draws the hosts table for a terminal.
"""

from __future__ import annotations

import sys

from .postcheck_gate import gate_smoke, smoke_client_placement
from .postcheck_parse import format_percentile


def fmt(value, digits=3):
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return "%.*f" % (digits, value)
    return str(value)


def cpu_name(row):
    return str(row["cpu"]) if row["cpu"] is not None else "t%d" % row["thread"]


# --------------------------------------------------------------------------- fleet


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
        "ct_max_us": fmt(summary.get("max_us")) if summary else ("error" if ct else "-"),
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


def fleet_table(hosts):
    """The hosts table: one :func:`host_summary` row per host."""
    rows = [host_summary(h) for h in hosts]
    return (
        [c for c, _key in _FLEET_COLUMNS],
        [[r[k] for _title, k in _FLEET_COLUMNS] for r in rows],
    )


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


def before_after_table(rows):
    """The before/after table from report_fleet.before_after's rows."""
    return _BEFORE_AFTER_COLUMNS, [_before_after_cells(r) for r in rows]


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


# --------------------------------------------------------------------------- one host


_CPU_COLUMNS = ("CPU", "node", "cycles", "min µs", "avg µs", "max µs", "p99 µs", "p99.9 µs")
_CPU_COLUMNS += ("overflows",)


def _latency_cells(row, avg_digits, end_us):
    """min, avg, max, p99 and p99.9 of one CPU's row; ``end_us``: where its histogram ends."""
    return [
        str(row["min_us"]),
        "%.*f" % (avg_digits, row["avg_us"]),
        str(row["max_us"]),
        format_percentile(row, "p99", end_us),
        format_percentile(row, "p999", end_us),
    ]


def _cpu_cells(row, hist_us):
    return [
        cpu_name(row),
        fmt(row["node"]),
        str(row["cycles"]),
        *_latency_cells(row, 2, hist_us),
        fmt(row["overflows"]),
    ]


def cyclictest_table(ct):
    """A host's cyclictest CPUs: one row per measuring thread."""
    hist_us = ct["summary"]["histogram_us"]
    return _CPU_COLUMNS, [_cpu_cells(r, hist_us) for r in ct["cpus"]]


_OSLAT_COLUMNS = ("CPU", "loops", "min µs", "avg µs", "max µs", "p99 µs", "p99.9 µs")
_OSLAT_COLUMNS += ("≥ last bucket",)
_HWLAT_COLUMNS = ("seconds in", "inner µs", "outer µs")


def _oslat_cells(row):
    return [
        cpu_name(row),
        str(row["loops"]),
        *_latency_cells(row, 3, row["bucket_us"]),
        str(row["overflows"]),
    ]


def oslat_table(osl):
    """A host's oslat CPUs: one row per measured CPU."""
    return _OSLAT_COLUMNS, [_oslat_cells(r) for r in osl["cpus"]]


def hwlat_table(hw):
    """The worst 20 of a host's hwlatdetect samples above the threshold, or None."""
    if not hw["samples"]:
        return None
    start = min(float(x["ts"]) for x in hw["samples"])
    worst = sorted(hw["samples"], key=lambda x: -max(x["inner_us"], x["outer_us"]))
    return (
        _HWLAT_COLUMNS,
        [
            ["%.3f" % (float(x["ts"]) - start), str(x["inner_us"]), str(x["outer_us"])]
            for x in worst[:20]
        ],
    )


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
        fmt(unit.get("requests")),
        fmt(unit.get("errors")),
        _ms(unit.get("latency_ms_p50")),
        _ms(unit.get("latency_ms_p99")),
        _ms(unit.get("latency_ms_p999")),
        _ms(unit.get("latency_ms_max")),
        _ms(unit.get("latency_jitter")),
        _ms(unit.get("deschedule_ms_p999")),
        _ms(unit.get("cpu_ratio")),
        fmt(unit.get("slow_infer")),
        "no" if gate_smoke(unit, thresholds) else "yes",
    ]


def smoke_table(entry):
    """A host's shminfer smoke units, each judged with its host's thresholds."""
    return _SMOKE_COLUMNS, [_smoke_cells(u, entry["thresholds"]) for u in entry["smoke"]]


def consistency_table(entry):
    """A host's consistency checks, as the post-check recorded them."""
    return (
        ("check", "ok", "detail"),
        [
            (c.get("check"), "yes" if c.get("ok") else "no", c.get("detail", ""))
            for c in entry["consistency"]
        ],
    )


__all__ = [
    "before_after_table",
    "consistency_table",
    "cpu_name",
    "cyclictest_table",
    "fleet_table",
    "fmt",
    "host_summary",
    "hwlat_table",
    "oslat_table",
    "render_fleet_table",
    "smoke_table",
]
