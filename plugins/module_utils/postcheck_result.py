"""What the post-check measures on a host, and the result it records (postcheck.py's schema).

Two steps the post-check role used to write in Jinja, here as tested Python behind the
``rtfleet.fleet.postcheck_targets`` and ``rtfleet.fleet.postcheck_result`` filters:

* :func:`measure_targets` -- from the plan record (a tuned host) or the online CPUs (a
  baseline host): the CPUs to measure, the housekeeping CPUs the load runs on, the units to
  smoke-test and, for each, the CPU its smoke client is pinned to and why there;
* :func:`assemble_result` -- the per-host result from what the role read and ran.
Stdlib only.
"""

from __future__ import annotations

import base64
import json
import re

from .cpulist import format_cpulist
from .postcheck import SCHEMA_VERSION, PostcheckError

_NAN = re.compile(r":(\s*)-?nan")
# A plan record without sampler CPUs (written before they were planned): any housekeeping CPU.
_NO_SAMPLER_CPUS = "housekeeping (plan record without sampler CPUs)"


def measure_targets(plan, online, kind, cpus=None, smoke=True):
    """``{"cpus", "housekeeping", "units", "clients", "clients_from"}`` of one host.

    ``plan``: the plan (read_plan's; ``{}`` on a baseline host); ``online``: the online
    CPUs; ``kind``: "tuned" or "baseline"; ``cpus``: rtfleet_postcheck_cpus (a cpulist that
    overrides what is measured); ``smoke``: whether units are smoke-tested. A tuned host
    measures its isolated CPUs with the load on its housekeeping; a baseline host (the old
    VM) measures every CPU but the first, which carries the load.
    """
    plan = plan or {}
    tuned = kind == "tuned"
    if tuned:
        measured = format_cpulist(plan.get("isolated") or [])
        housekeeping = format_cpulist(plan.get("housekeeping") or [])
    else:
        measured = format_cpulist(list(online)[1:])
        housekeeping = format_cpulist(list(online)[:1])
    groups = plan.get("runtime_groups") or []
    near = plan.get("housekeeping") or [0]
    return {
        "cpus": cpus or measured,
        "housekeeping": housekeeping,
        "units": [g["name"] for g in groups] if tuned and smoke else [],
        "clients": [(g.get("sampler_cpus") or near)[0] for g in groups],
        "clients_from": [g.get("sampler_cpus_from", _NO_SAMPLER_CPUS) for g in groups],
    }


def _tool_json(b64, what, nan=False):
    """A tool's --json document as the role slurped it (base64)."""
    text = base64.b64decode(b64).decode("utf-8", errors="replace")
    if nan:  # cyclictest writes nan for a CPU that never woke
        text = _NAN.sub(r":\1null", text)
    try:
        return json.loads(text)
    except ValueError as exc:
        raise PostcheckError("%s wrote no JSON document (%s)" % (what, exc)) from None


def _tool(measured, name, doc, extra):
    """One tool's entry: its document and how it ran; else skipped or not run."""
    if doc is not None:
        return {
            "json": _tool_json(doc, name, nan=name == "cyclictest"),
            "load": measured.get("load"),
            "duration_s": int(measured["seconds"][name]),
            "cpus": measured.get("cpus"),
            **extra,
        }
    if measured["run"].get(name):
        failures = "; ".join(str(f) for f in measured.get("hardware_failures") or [])
        return {"skipped": "hwlatdetect failed first (%s)" % failures}
    return (measured.get("not_run") or {}).get(name)


def _smoke(measured):
    """``shminfer smoke --format json`` per unit, with where the role pinned its client."""
    out = []
    for stdout, cpu, why in zip(
        measured.get("smoke_stdout") or [],
        measured.get("clients") or [],
        measured.get("clients_from") or [],
    ):
        try:
            record = json.loads(stdout)
        except ValueError as exc:
            raise PostcheckError("shminfer smoke wrote no JSON document (%s)" % exc) from None
        out.append({**record, "client_cpu": cpu, "client_cpu_from": why})
    return out


def assemble_result(measured, thresholds):
    """The per-host result (postcheck.py's schema, without its gate) from what the role read
    and ran (``measured``) and the limits it gates with (``thresholds``)."""
    running = measured.get("running") or {}
    plan = measured.get("plan") or {}
    virt = str(measured.get("virtualization") or "").strip()
    return {
        "schema": SCHEMA_VERSION,
        "host": measured["host"],
        "kind": measured["kind"],
        "collected_at": measured["collected_at"],
        "virtualization": virt or None,
        "kernel": {
            "release": running.get("release"),
            "realtime": running.get("realtime"),
            "cmdline": " ".join(running.get("args") or []),
        },
        "plan": {
            "housekeeping": measured.get("housekeeping"),
            "isolated": format_cpulist(plan.get("isolated") or []),
            "runtime_groups": {
                g["name"]: g.get("cpulist") for g in plan.get("runtime_groups") or []
            },
        },
        "hwlatdetect": measured.get("hwlatdetect"),
        "cyclictest": _tool(measured, "cyclictest", measured.get("cyclictest_b64"), {}),
        "oslat": _tool(
            measured,
            "oslat",
            measured.get("oslat_b64"),
            {"priority": int(measured.get("oslat_priority") or 0)},
        ),
        "smoke": _smoke(measured),
        "consistency": measured.get("consistency") or [],
        "thresholds": dict(thresholds),
    }


__all__ = ["assemble_result", "measure_targets"]
