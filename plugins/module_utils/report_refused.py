"""The fleet report's "Refused hosts" section: why assess set each host aside.

``playbooks/assess.yml`` (the post-check role's ``refused`` entry point) writes the
topology-deception verdict of every refused host to ``refused/<host>.json`` below the
post-check results directory; :func:`load_refused` reads them into ``fleet.json``'s
``refused`` list and the renderers add one section to ``report.md`` and ``report.html``,
beside the before/after table that the same hosts' baseline measurements feed.
"""

from __future__ import annotations

from . import report_doc as doc

_COLUMNS = ("host", "hypervisor", "shown to the guest", "verdict")


def load_refused(results_dirs):
    """[entry] from every ``<dir>/refused/*.json``; an unreadable file is an entry with
    ``error`` (the report still builds)."""
    return doc.load_records(results_dirs, "refused", _parse)


def _parse(record):
    shown = record.get("shown") or {}
    return {
        "host": str(record["host"]),
        "summary": str(record["summary"]),
        "evidence": [str(e) for e in record["evidence"]],
        "hypervisor": record.get("hypervisor"),
        "shown": {k: int(v) for k, v in shown.items()},
    }


def _shown(entry):
    shown = entry["shown"]
    parts = [
        "%d %s" % (shown[key], one if shown[key] == 1 else many)
        for key, one, many in (
            ("cpus", "CPU", "CPUs"),
            ("sockets", "socket", "sockets"),
            ("numa_nodes", "NUMA node", "NUMA nodes"),
            ("l3_groups", "L3 group", "L3 groups"),
        )
        if key in shown
    ]
    return ", ".join(parts) or "-"


def _row(entry):
    if "error" in entry:
        return [entry["host"], "-", "-", "unreadable: %s" % entry["error"]]
    return [entry["host"], entry["hypervisor"] or "-", _shown(entry), entry["summary"]]


def refused_blocks(entries):
    """The Refused hosts section as report_doc blocks (none when assess refused no host)."""
    if not entries:
        return []
    out = [
        doc.heading(2, "Refused hosts"),
        doc.para(
            "Not tuned: their topology hides what pinning needs (the field reports' VMware "
            "guests). Move them to bare metal or a VM that shows sockets, NUMA nodes and L3."
        ),
        doc.table(_COLUMNS, [_row(e) for e in entries], "refused"),
    ]
    for entry in entries:
        if "error" in entry or not entry["evidence"]:
            continue
        out.append(doc.para("Evidence on %s:" % entry["host"]))
        out.append(doc.bullets(doc.item(evidence) for evidence in entry["evidence"]))
    return out
