"""The post-check's consistency step: the kernel, kubelet and units a host runs against its plan.

:func:`consistency_checks` compares what the post-check read on the host (the boot state,
the kubelet drop-in, ``systemctl show`` per unit and ``rtfleet-drift --check --json``) with
the plan record, one named check per line of the result's ``consistency`` list; the gate
(``postcheck_gate.py``) fails the host on any that is not ``ok``.
"""

from __future__ import annotations

from .postcheck import PostcheckError
from .cpulist import TopologyError, parse_cpulist


def _systemctl_show(text):
    """``systemctl show --property=...`` output (KEY=VALUE lines) -> dict."""
    shown = {}
    for line in str(text or "").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            shown[key.strip()] = value.strip()
    return shown


def _cpus(text):
    try:
        return parse_cpulist(str(text or "").strip())
    except TopologyError:
        return None


def _planned_groups(plan, units_shown):
    """The plan's runtime groups, with one ``systemctl show`` output for each."""
    if not isinstance(plan, dict) or not isinstance(plan.get("runtime_groups"), list):
        raise PostcheckError("consistency: the plan has no runtime_groups list")
    groups = plan["runtime_groups"]
    if not isinstance(units_shown, list) or len(units_shown) != len(groups):
        raise PostcheckError(
            "consistency: %s systemctl show outputs for %d runtime groups"
            % (len(units_shown) if isinstance(units_shown, list) else "no", len(groups))
        )
    return groups


def _boot_check(boot):
    boot = boot if isinstance(boot, dict) else {}
    mismatches = [str(m) for m in boot.get("mismatches") or []]
    return {
        "check": "running kernel and /proc/cmdline = host record",
        "ok": not mismatches,
        "detail": "; ".join(mismatches) or str((boot.get("running") or {}).get("release", "")),
    }


def _kubelet_check(plan, kubelet_config, kubelet_dropin):
    reserved = (kubelet_config or {}).get("reservedSystemCPUs")
    planned = (plan.get("kubelet") or {}).get("reservedSystemCPUs")
    if reserved is None:
        return {
            "check": "kubelet reservedSystemCPUs = plan",
            "ok": True,
            "detail": "skipped: no %s (kubelet role not run, or main-config mode)" % kubelet_dropin,
        }
    return {
        "check": "kubelet reservedSystemCPUs = plan",
        "ok": _cpus(reserved) is not None and _cpus(reserved) == _cpus(planned),
        "detail": "kubelet %s, plan %s" % (reserved, planned),
    }


def _unit_threads(drift):
    """The drift document's ``unit_threads`` check: per unit, its threads and those outside."""
    try:
        return drift["checks"]["unit_threads"].get("units") or {}
    except (TypeError, KeyError, AttributeError):
        return {}


def _unit_check(group, shown):
    """The unit's CPUAffinity and NUMA binding as systemd shows them, against its group."""
    node = group.get("memory_node", group.get("numa_node"))
    active = shown.get("ActiveState", "")
    return {
        "check": "shminfer@%s CPUAffinity/NUMA = plan" % group["name"],
        "ok": active == "active"
        and _cpus(shown.get("CPUAffinity")) == list(group["cpus"])
        and shown.get("NUMAPolicy") == "bind"
        and _cpus(shown.get("NUMAMask")) == [node],
        "detail": "%s, CPUAffinity %s (plan %s), NUMA %s:%s (plan bind:%s)"
        % (
            active,
            shown.get("CPUAffinity", ""),
            group["cpulist"],
            shown.get("NUMAPolicy", ""),
            shown.get("NUMAMask", ""),
            node,
        ),
    }


def _threads_check(group, contained):
    """Every thread of the unit allowed on, and last run on, its group's CPUs."""
    contained = contained or {"threads": 0, "outside": []}
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

    ``plan``: /etc/rtfleet/plan.json. ``observed`` holds what the post-check read on the
    host: ``boot``, rtfleet.fleet.boot_state's result with the host record as ``wanted``
    (its ``mismatches`` and ``running``); ``kubelet``, the parsed rtfleet drop-in, or ``{}``
    when there is none, and ``kubelet_dropin``, its path; ``units``, one ``systemctl show
    --property=CPUAffinity,NUMAPolicy,NUMAMask,MainPID,ActiveState`` output per runtime
    group, in the plan's order; ``drift``, ``rtfleet-drift --check --json``'s document,
    whose ``unit_threads`` check says where every thread of every unit may run and last ran
    (the field reports' "engine threads outside the pinned range").
    """
    observed = observed if isinstance(observed, dict) else {}
    units_shown = observed.get("units")
    groups = _planned_groups(plan, units_shown)
    out = [
        _boot_check(observed.get("boot")),
        _kubelet_check(
            plan,
            observed.get("kubelet"),
            observed.get("kubelet_dropin", "the kubelet drop-in"),
        ),
    ]
    units = _unit_threads(observed.get("drift"))
    for group, text in zip(groups, units_shown):
        out.append(_unit_check(group, _systemctl_show(text)))
        out.append(_threads_check(group, units.get("shminfer@%s.service" % group["name"])))
    return out


__all__ = ["consistency_checks"]
