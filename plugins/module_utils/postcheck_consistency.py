"""The post-check's consistency step: the kernel, kubelet and units a host runs against its plan.

:func:`consistency_checks` turns what the post-check read on the host -- the boot state and
``rtfleet-drift --check --json``, the drift guard's document -- into one named line per check
of the result's ``consistency`` list; the gate (``postcheck_gate.py``) fails the host on any
that is not ``ok``. The comparisons with the plan are the drift guard's (drift_units.py:
``units``, ``unit_threads``, ``kubelet``), the one checker of a host against its plan, which
the testinfra suite runs too; this module only words them for the report.
"""

from __future__ import annotations

from .postcheck import PostcheckError


def _planned_groups(plan):
    if not isinstance(plan, dict) or not isinstance(plan.get("runtime_groups"), list):
        raise PostcheckError("consistency: the plan has no runtime_groups list")
    return plan["runtime_groups"]


def _drift_checks(drift):
    """The drift document's checks; PostcheckError when it is not one."""
    checks = drift.get("checks") if isinstance(drift, dict) else None
    if not isinstance(checks, dict):
        raise PostcheckError("consistency: no rtfleet-drift --check --json document to read")
    return {k: v for k, v in checks.items() if isinstance(v, dict)}


def _boot_check(boot):
    boot = boot if isinstance(boot, dict) else {}
    mismatches = [str(m) for m in boot.get("mismatches") or []]
    return {
        "check": "running kernel and /proc/cmdline = host record",
        "ok": not mismatches,
        "detail": "; ".join(mismatches) or str((boot.get("running") or {}).get("release", "")),
    }


def _kubelet_check(kubelet, kubelet_dropin):
    check = "kubelet reservedSystemCPUs = plan"
    status = kubelet.get("status")
    details = "; ".join(str(d) for d in kubelet.get("details") or [])
    if status == "skipped":
        return {"check": check, "ok": True, "detail": "skipped: " + details}
    if "reserved" not in kubelet:
        return {
            "check": check,
            "ok": False,
            "detail": details or "the drift guard did not read %s" % kubelet_dropin,
        }
    return {
        "check": check,
        "ok": status == "ok",
        "detail": "kubelet %s, plan %s" % (kubelet.get("reserved"), kubelet.get("planned")),
    }


def _unit_check(group, seen, why_missing):
    """The drift guard's view of one unit (what systemd showed, and what is off)."""
    node = group.get("memory_node", group.get("numa_node"))
    check = "shminfer@%s CPUAffinity/NUMA = plan" % group["name"]
    if not isinstance(seen, dict):
        return {"check": check, "ok": False, "detail": why_missing}
    return {
        "check": check,
        "ok": seen.get("active") == "active" and not seen.get("problems"),
        "detail": "%s, CPUAffinity %s (plan %s), NUMA %s:%s (plan bind:%s)"
        % (
            seen.get("active", ""),
            seen.get("cpu_affinity", ""),
            group["cpulist"],
            seen.get("numa_policy", ""),
            seen.get("numa_mask", ""),
            node,
        ),
    }


def _threads_check(group, contained):
    """Every thread of the unit allowed on, and last run on, its group's CPUs."""
    contained = contained if isinstance(contained, dict) else {"threads": 0, "outside": []}
    outside = contained.get("outside") or []
    detail = "%s threads of %s processes" % (
        contained.get("threads", 0),
        contained.get("processes", 0),
    )
    if outside:
        detail += ", outside: %s (allowed %s, last ran on %s)" % (
            ", ".join(str(t.get("comm")) for t in outside[:5]),
            " | ".join(sorted({str(t.get("cpus_allowed")) for t in outside})),
            ",".join(sorted({str(t.get("last_cpu")) for t in outside})),
        )
    else:
        detail += ", all allowed and last run on the group"
    return {
        "check": "shminfer@%s threads inside %s" % (group["name"], group["cpulist"]),
        "ok": contained.get("threads", 0) > 0 and not outside,
        "detail": detail,
    }


def consistency_checks(plan, observed):
    """Kernel, kubelet and units against the plan: ``[{"check", "ok", "detail"}, ...]``.

    ``plan``: the plan record as read_plan reads it. ``observed`` holds what the post-check
    read on the host: ``boot``, rtfleet.fleet.boot_state's result with the host record as
    ``wanted`` (its ``mismatches`` and ``running``); ``drift``, ``rtfleet-drift --check
    --json``'s document, whose ``kubelet`` check compares the drop-in (``kubelet_dropin``,
    its path) with the plan, ``units`` each unit's CPUAffinity and NUMA binding as systemd
    shows them, and ``unit_threads`` where every thread of every unit may run and last ran
    (the field reports' "engine threads outside the pinned range").
    """
    observed = observed if isinstance(observed, dict) else {}
    groups = _planned_groups(plan)
    checks = _drift_checks(observed.get("drift"))
    dropin = observed.get("kubelet_dropin", "the kubelet drop-in")
    units_check = checks.get("units", {})
    units = units_check.get("units") if isinstance(units_check.get("units"), dict) else {}
    why_missing = "the drift guard showed nothing of it (%s)" % (
        "; ".join(str(d) for d in units_check.get("details") or []) or "no units check"
    )
    threads_check = checks.get("unit_threads", {})
    threads = threads_check.get("units") if isinstance(threads_check.get("units"), dict) else {}
    out = [
        _boot_check(observed.get("boot")),
        _kubelet_check(checks.get("kubelet", {}), dropin),
    ]
    for group in groups:
        unit = "shminfer@%s.service" % group["name"]
        out.append(_unit_check(group, units.get(unit), why_missing))
        out.append(_threads_check(group, threads.get(unit)))
    return out


__all__ = ["consistency_checks"]
