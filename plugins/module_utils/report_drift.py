"""The fleet report's Drift section: what ``rtfleet-drift`` found on each host.

``playbooks/verify.yml`` writes each host's result (schema in :mod:`rtfleet.drift`) to
``drift/<host>.json`` below the post-check results directory; :func:`load_drift` reads
them into ``fleet.json``'s ``drift`` list and the renderers add one section to
``report.md`` and ``report.html``. Drift does not change the fleet verdict (that is the
post-check's); it says which hosts no longer run what was verified.
"""

from __future__ import annotations

from .drift_checks import CHECKS as CHECK_ORDER
from . import report_doc as doc


def load_drift(results_dirs):
    """[host entry] from every ``<dir>/drift/*.json``; an unreadable file is an entry with
    ``error`` (the report still builds)."""
    return doc.load_records(results_dirs, "drift", _parse)


def _parse(result):
    checks = result["checks"]
    return {
        "host": result.get("inventory_host") or result["host"],
        "checked_at": result.get("checked_at"),
        "mode": result.get("mode"),
        "drift": bool(result.get("drift")),
        "repinned_irqs": len(checks["irqs"].get("repinned") or []),
        "would_repin_irqs": len(checks["irqs"].get("would_repin") or []),
        "unmovable_irqs": list(checks["irqs"].get("unmovable") or []),
        "checks": {
            name: {
                "status": check["status"],
                "details": list(check.get("details") or []),
            }
            for name, check in checks.items()
        },
    }


def _names(checks, *statuses):
    order = [n for n in CHECK_ORDER if n in checks] + sorted(set(checks) - set(CHECK_ORDER))
    return [n for n in order if checks[n]["status"] in statuses]


def _row(entry):
    if "error" in entry:
        return [entry["host"], "unreadable", "-", "-", entry["error"]]
    checks = entry["checks"]
    drifted = _names(checks, "drift")
    irqs = entry["repinned_irqs"] or entry["would_repin_irqs"]
    verb = "re-pinned" if entry["mode"] == "repair" else "would re-pin"
    return [
        entry["host"],
        "DRIFT" if entry["drift"] else "none",
        entry["checked_at"] or "?",
        "%s %d" % (verb, irqs) if irqs else "-",
        ", ".join(drifted) or "-",
    ]


_COLUMNS = ("host", "drift", "checked", "IRQs", "drifted checks")


def drift_blocks(entries):
    """The Drift section as report_doc blocks (none when no host has a drift result)."""
    if not entries:
        return []
    drifted = [e["host"] for e in entries if e.get("drift") or "error" in e]
    out = [
        doc.heading(2, "Drift"),
        doc.para(
            "rtfleet-drift on %d host(s): " % len(entries),
            doc.span("drift on " + ", ".join(drifted), "fail")
            if drifted
            else doc.span("no drift", "pass"),
            ".",
        ),
        doc.table(_COLUMNS, [_row(e) for e in entries], "drift"),
    ]
    for entry in entries:
        if "error" in entry:
            continue
        checks = entry["checks"]
        names = _names(checks, "drift", "repaired")
        if names:
            out.append(doc.heading(3, "Drift on %s" % entry["host"]))
            out.append(
                doc.bullets(
                    doc.item("%s (%s): %s" % (name, checks[name]["status"], detail))
                    for name in names
                    for detail in checks[name]["details"]
                )
            )
    return out
