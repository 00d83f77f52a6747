"""The fleet report's "Stopped migrations" section: hosts whose migration failed, and where.

``playbooks/rollout.yml``'s rescue (the post-check role's ``stopped`` entry point) writes
``stopped/<host>.json`` below the post-check results directory when a host's migration
fails at any step, the post-check's gate or long before it (a trial boot that does not
match, a runtime that does not start); the same entry point removes it once the host
migrates to the end. :func:`load_stopped` reads them into ``fleet.json``'s ``stopped``
list; a stopped host fails the fleet even when an older post-check result of it passed.
"""

from __future__ import annotations

from . import report_doc as doc

_COLUMNS = ("host", "stopped at", "why", "when")


def load_stopped(results_dirs):
    """[entry] from every ``<dir>/stopped/*.json``; an unreadable file is an entry with
    ``error`` (the report still builds, and the host still counts as stopped)."""
    return doc.load_records(results_dirs, "stopped", _parse)


def _parse(record):
    return {
        "host": str(record["host"]),
        "task": str(record["task"]),
        "message": str(record["message"]),
        "at": str(record.get("at") or ""),
    }


def _row(entry):
    if "error" in entry:
        return [entry["host"], "-", "unreadable record: %s" % entry["error"], "-"]
    return [entry["host"], entry["task"], entry["message"], entry["at"] or "-"]


def stopped_blocks(entries):
    """The Stopped migrations section as report_doc blocks (none when no host stopped)."""
    if not entries:
        return []
    return [
        doc.heading(2, "Stopped migrations"),
        doc.para(
            "These hosts failed a step of their migration and stay cordoned (when the "
            "rollout drained them); docs/failure.md says what each step leaves and what a "
            "re-run does with it."
        ),
        doc.table(_COLUMNS, [_row(e) for e in entries], "stopped"),
    ]
