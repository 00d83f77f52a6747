"""The fleet report's "Containerised sampler" section: the sampler pod, run for real.

``playbooks/samplers.yml`` runs one replica of each tuned host's sampler manifest in a
container (podman, with the manifest's user, groups, mounts and limits, on whole pod-pool
CPUs of one NUMA node: what a kubelet with the static CPU Manager would give the pod) and
writes ``containers/<host>.json`` below the post-check results directory. This module reads
them into ``fleet.json``'s ``containers`` list and renders the section beside the host-side
smoke test: which unit the sampler found and why, its round trip and deschedule figures,
and whether its smoke gates held. No kubelet ran; the section says so.
"""

from __future__ import annotations

import json

from . import report_doc as doc
from .cpulist import TopologyError, format_cpulist, parse_cpulist

_COLUMNS = (
    "host",
    "sampler CPUs (node)",
    "unit found",
    "round trip p50 / p99 / p99.9 ms",
    "deschedule p99.9 ms",
    "gates",
)
NOTE = (
    "One replica of each host class's sampler manifest, run by podman with the manifest's "
    "user, supplementary group, read-only /run/shminfer mount, environment and limits, on "
    "whole pod-pool CPUs of one NUMA node and memory on that node: what a kubelet with the "
    "static CPU and Memory Managers would give the pod. No kubelet ran here."
)


def load_containers(results_dirs):
    """[entry] from every ``<dir>/containers/*.json``; an unreadable file or a run that
    printed no result is an entry with ``error`` (the report still builds)."""
    return doc.load_records(results_dirs, "containers", _entry)


def _entry(record):
    entry = {
        "host": str(record["host"]),
        "runtime": str(record["runtime"]),
        "image": str(record["image"]),
        "argv": [str(a) for a in record["argv"]],
        "cpus": [int(c) for c in record["cpus"]],
        "numa_node": int(record["numa_node"]),
    }
    try:
        smoke = json.loads(record.get("stdout") or "")
        choice = smoke.get("choice") or {}
        entry["smoke"] = {
            "unit": str(smoke["server"]),
            "rule": choice.get("rule"),
            "reason": choice.get("reason"),
            "unit_node": choice.get("unit_node"),
            "latency_ms": [
                float(smoke[k]) for k in ("latency_ms_p50", "latency_ms_p99", "latency_ms_p999")
            ],
            "deschedule_ms_p999": smoke.get("deschedule_ms_p999"),
            # The sampler's own affinity as it ran (shminfer smoke records it), or None.
            "client_cpus": smoke.get("client_cpus"),
            "passed": bool(smoke["passed"]),
            "failures": [str(f) for f in smoke.get("failures") or []],
        }
    except (ValueError, KeyError, TypeError, AttributeError):
        last = (record.get("stderr") or "").strip().splitlines()[-1:] or ["no output"]
        entry["error"] = "the sampler printed no result (exit %s): %s" % (record.get("rc"), last[0])
    return entry


def _ran_elsewhere(entry):
    """The CPUs the sampler ran on, when it recorded them and they are not the ones the
    container was given; else None."""
    ran = entry.get("smoke", {}).get("client_cpus")
    if ran is None:
        return None
    try:
        ran_cpus = parse_cpulist(str(ran), "client_cpus")
    except TopologyError:
        return str(ran)
    return None if ran_cpus == sorted(entry.get("cpus", [])) else format_cpulist(ran_cpus)


def _row(entry):
    where = "%s (node %s)" % (
        ",".join(map(str, entry.get("cpus", []))) or "-",
        entry.get("numa_node", "-"),
    )
    elsewhere = None if "error" in entry else _ran_elsewhere(entry)
    if elsewhere is not None:
        where = "ran on %s, given %s" % (elsewhere or "-", where)
    if "error" in entry:
        return [entry["host"], where, "-", "-", "-", "error: %s" % entry["error"]]
    smoke = entry["smoke"]
    found = "%s on node %s (%s)" % (smoke["unit"], smoke["unit_node"], smoke["rule"])
    desched = smoke["deschedule_ms_p999"]
    return [
        entry["host"],
        where,
        found,
        " / ".join("%.3f" % v for v in smoke["latency_ms"]),
        "-" if desched is None else "%.3f" % desched,
        "passed" if smoke["passed"] else "failed: " + "; ".join(smoke["failures"]),
    ]


def containers_blocks(entries):
    """The Containerised sampler section as report_doc blocks (none when no container ran)."""
    if not entries:
        return []
    out = [
        doc.heading(2, "Containerised sampler"),
        doc.para(NOTE),
        doc.table(_COLUMNS, [_row(e) for e in entries], "containers"),
    ]
    for entry in entries:
        if "error" not in entry:
            out.append(
                doc.para("%s: %s, image %s" % (entry["host"], entry["runtime"], entry["image"]))
            )
            if entry["smoke"]["reason"]:
                out.append(doc.para("(%s)" % entry["smoke"]["reason"]))
    return out


def containers_failed(entries):
    """One line per host whose containerised sampler did not reach its own unit or broke a
    smoke gate (the report's verdict counts them)."""
    failed = []
    for entry in entries:
        elsewhere = None if "error" in entry else _ran_elsewhere(entry)
        if "error" in entry:
            failed.append("%s: containerised sampler: %s" % (entry["host"], entry["error"]))
        elif elsewhere is not None:
            failed.append(
                "%s: containerised sampler ran on CPUs %s, not on the CPUs %s it was given"
                % (entry["host"], elsewhere or "-", format_cpulist(entry["cpus"]))
            )
        elif entry["smoke"]["unit_node"] != entry["numa_node"]:
            failed.append(
                "%s: containerised sampler on CPUs %s (node %d) used unit %s on node %s"
                % (
                    entry["host"],
                    entry["cpus"],
                    entry["numa_node"],
                    entry["smoke"]["unit"],
                    entry["smoke"]["unit_node"],
                )
            )
        elif not entry["smoke"]["passed"]:
            failed.append(
                "%s: containerised sampler: %s"
                % (entry["host"], "; ".join(entry["smoke"]["failures"]))
            )
    return failed
