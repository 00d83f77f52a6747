"""The fleet report: every host's post-check result, its verdict, plots, before and after.

``build_report(results_dir, out_dir)`` reads the per-host ``*.json`` files the post-check
role wrote (schema in ``postcheck.py``), re-gates each host with ``postcheck_gate.gate_host``
(``report_fleet.py``) and writes (the HTML and the Markdown from one document,
:func:`report_blocks`, through the Jinja2 templates of ``report_doc.py``; the tables'
cells from ``report_tables.py``, the plots from ``report_plots.py``)::

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

import json
import os
from pathlib import Path

from .postcheck_gate import DEFAULT_HWLATDETECT_MAX_US
from . import report_doc as doc
from . import report_tables as tables
from .report_tables import fmt
from .report_containers import containers_blocks, containers_failed, load_containers
from .report_drift import drift_blocks, load_drift
from .report_files import report_lock, safe_name, write_text
from .report_fleet import evaluate_fleet, load_results
from .report_plots import write_plots
from .report_refused import load_refused, refused_blocks
from .report_stopped import load_stopped, stopped_blocks


def _plan_text(plan):
    if not plan:
        return "-"
    parts = ["housekeeping %s" % plan.get("housekeeping", "?")]
    parts.append("isolated %s" % plan.get("isolated", "?"))
    groups = plan.get("runtime_groups") or {}
    if groups:
        parts.append("groups " + ", ".join("%s=%s" % kv for kv in sorted(groups.items())))
    return "; ".join(parts)


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


def _hwlat_block(entry, hw):
    """(title, sentence, table or None) of a host's hwlatdetect run."""
    if "skipped" in hw:
        return ("hwlatdetect", "Not run: %s." % hw["skipped"].rstrip("."), None)
    if "error" in hw:
        return ("hwlatdetect", "Unreadable: %s" % hw["error"], None)
    limit = entry["thresholds"].get("hwlatdetect_max_us", DEFAULT_HWLATDETECT_MAX_US)
    sentence = "%s s on CPUs %s, threshold %s µs (limit %s µs), width %s of every %s µs: " % (
        fmt(hw.get("duration_s")),
        hw.get("cpus") or "?",
        fmt(hw.get("threshold_us")),
        fmt(limit),
        fmt(hw.get("width_us")),
        fmt(hw.get("window_us")),
    )
    if hw["samples"]:
        sentence += "%d samples above the threshold, worst %d µs%s." % (
            len(hw["samples"]),
            hw["max_us"],
            "" if hw.get("smis") is None else ", %d SMIs" % hw["smis"],
        )
    else:
        sentence += "no gap above the threshold."
    return ("hwlatdetect", sentence, tables.hwlat_table(hw))


def _oslat_block(osl):
    """(title, sentence, table or None) of a host's oslat run."""
    if "skipped" in osl:
        return ("oslat", "Not run: %s." % osl["skipped"].rstrip("."), None)
    if "error" in osl:
        return ("oslat", "Unreadable: %s" % osl["error"], None)
    summary = osl["summary"]
    sentence = "rt-tests %s, %s s on CPUs %s at %s, load: %s, 1 µs buckets to %d µs." % (
        summary["version"],
        fmt(summary["duration_s"]),
        summary["cpus"],
        "SCHED_FIFO %s" % osl["priority"] if osl.get("priority") else "SCHED_OTHER",
        osl.get("load") or "none recorded",
        summary["bucket_us"],
    )
    return ("oslat", sentence, tables.oslat_table(osl))


def _tool_blocks(entry):
    """[(title, sentence, (header, rows) or None)] for hwlatdetect and oslat, in run order."""
    blocks = []
    if entry.get("hwlatdetect") is not None:
        blocks.append(_hwlat_block(entry, entry["hwlatdetect"]))
    if entry.get("oslat") is not None:
        blocks.append(_oslat_block(entry["oslat"]))
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
        doc.table(*tables.fleet_table(fleet["hosts"]), "fleet"),
    ]
    if fleet["before_after"]:
        out += [
            doc.heading(2, "Before and after"),
            doc.para(
                "Worst host of each kind; baseline = the old VMs before migration. Lower is "
                "better; ≥ N means beyond cyclictest's histogram (no ratio)."
            ),
            doc.table(*tables.before_after_table(fleet["before_after"]), "before-after"),
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


def _cyclictest_blocks(ct):
    """The cyclictest section of a host: why it did not run, or its run and CPUs."""
    if "skipped" in ct:
        return [doc.heading(3, "cyclictest"), doc.para("Not run: %s." % ct["skipped"].rstrip("."))]
    out = [doc.heading(3, "cyclictest")]
    if "error" in ct:
        out.append(doc.para("Unreadable: %s" % ct["error"]))
        return out
    summary = ct["summary"]
    out += [
        doc.para(
            "rt-tests %s, %d cycles on CPUs %s, load: %s, histogram %s µs."
            % (
                summary["version"],
                summary["cycles"],
                summary["cpus"] or "?",
                ct.get("load") or "none recorded",
                fmt(summary["histogram_us"]),
            )
        ),
        doc.table(*tables.cyclictest_table(ct), "cpus"),
    ]
    return out


def _host_blocks(entry):
    out = [
        doc.heading(
            2,
            "%s (%s)" % (entry["host"], entry["kind"]),
            anchor="host-%s" % safe_name(entry["host"]),
        )
    ]
    emulated = _emulation_note(entry)
    if emulated:
        out.append(doc.note(emulated))
    out.append(doc.bullets(_host_facts(entry)))
    # hwlatdetect runs first, cyclictest next, then oslat: the order the post-check ran them.
    blocks = _tool_blocks(entry)
    for block in blocks[:1]:
        out.extend(_tool_section(*block))
    if entry["cyclictest"]:
        out.extend(_cyclictest_blocks(entry["cyclictest"]))
    for block in blocks[1:]:
        out.extend(_tool_section(*block))
    if entry["smoke"]:
        out += [doc.heading(3, "shminfer smoke"), doc.table(*tables.smoke_table(entry), "smoke")]
    if entry["consistency"]:
        out += [
            doc.heading(3, "Consistency checks"),
            doc.table(*tables.consistency_table(entry), "consistency"),
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


# --------------------------------------------------------------------------- entry point


def build_report(results_dir, out_dir, plots=True):
    """Read every per-host result, write fleet.json, report.md, report.html and plots/.

    ``results_dir`` is a directory or a list of them (e.g. tuned and baseline results
    kept apart). Returns the fleet document, with ``files`` naming what was written
    (paths relative to ``out_dir``). Raises :class:`ReportError` on bad input.
    """
    out_dir = Path(out_dir)
    fleet_json = out_dir / "fleet.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    with report_lock(out_dir):
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
        write_text(out_dir / "report.md", render_markdown(fleet))
        write_text(out_dir / "report.html", render_html(fleet))
        write_text(fleet_json, json.dumps(fleet, indent=2, ensure_ascii=False) + "\n")
    return fleet


__all__ = ["build_report", "render_html", "render_markdown", "report_blocks"]
