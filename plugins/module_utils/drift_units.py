# Copyright: rtfleet contributors
# Apache-2.0
"""The drift guard's checks of what runs on the host: each runtime unit's state, CPUs and
memory policy, every thread of its processes, and kubelet's reserved CPUs (each documented in
drift.py). Stdlib only."""

from __future__ import annotations

import json
import os
import re

from .cpulist import TopologyError, format_cpulist, parse_cpulist
from .drift_checks import check_result, judge, read_text, systemd_cpus, under


def unit_name(group):
    """The systemd unit of one runtime group of the plan."""
    return "shminfer@%s.service" % group["name"]


def _memory_node(group):
    return group.get("memory_node", group.get("numa_node"))


def _unit_pinning(group, shown):
    """What systemd shows of one group's unit against the group: ``{"active", "cpu_affinity",
    "numa_policy", "numa_mask", "problems"}`` (what systemd printed, and what is off)."""
    unit = unit_name(group)
    seen = {
        "active": shown.get("ActiveState") or shown.get("LoadState") or "",
        "cpu_affinity": shown.get("CPUAffinity", ""),
        "numa_policy": shown.get("NUMAPolicy", ""),
        "numa_mask": shown.get("NUMAMask", ""),
        "problems": [],
    }
    if seen["active"] != "active":
        seen["problems"].append("%s is %s" % (unit, seen["active"] or "unknown"))
        return seen
    try:
        have = systemd_cpus(seen["cpu_affinity"])
        mask = systemd_cpus(seen["numa_mask"])
    except TopologyError:
        have = mask = None
    if have != sorted(group["cpus"]):
        seen["problems"].append(
            "%s CPUAffinity is %s, the plan's group %s"
            % (unit, format_cpulist(have or []) or "unset", format_cpulist(group["cpus"]))
        )
    node = _memory_node(group)
    if node is not None and (seen["numa_policy"] != "bind" or mask != [node]):
        seen["problems"].append(
            "%s NUMA policy is %s:%s, the plan's bind:%s"
            % (unit, seen["numa_policy"] or "default", format_cpulist(mask or []), node)
        )
    return seen


def check_units(plan, units, runtime_installed):
    """Each runtime unit active, its CPUAffinity the group's CPUs and its memory bound to the
    group's node; ``units`` holds what systemd showed of each (the post-check's lines)."""
    groups = plan.get("runtime_groups") or []
    if not groups:
        return check_result("skipped", ["the plan has no runtime group"], units={})
    if not runtime_installed:
        return check_result(
            "skipped", ["shminfer@.service is not installed (runtime role not run)"], units={}
        )
    found = {unit_name(g): _unit_pinning(g, units.get(unit_name(g), {})) for g in groups}
    problems = [p for seen in found.values() for p in seen["problems"]]
    return judge(problems, ["%d units pinned and bound as planned" % len(groups)], units=found)


def _cgroup_pids(root, control_group):
    """Every process of a unit's cgroup and of the cgroups below it."""
    base = os.path.join(root, "sys/fs/cgroup", control_group.lstrip("/"))
    pids = set()
    for dirpath, _dirs, files in os.walk(base):
        if "cgroup.procs" in files:
            text = read_text(os.path.join(dirpath, "cgroup.procs")) or ""
            pids.update(int(p) for p in text.split() if p.isdigit())
    return sorted(pids)


def _task_stat(text):
    """(comm, last-run CPU) from /proc/PID/task/TID/stat; comm may hold spaces and ')'."""
    head, tail = text.rpartition(")")[::2]
    comm = head.partition("(")[2]
    fields = tail.split()  # fields[0] is field 3 (state): field 39 (processor) is [36]
    return comm, int(fields[36])


def thread_containment(root, pids, cpus):
    """Every thread of ``pids`` inside ``cpus``: its Cpus_allowed_list and its last CPU.

    Returns ``{"processes": int, "threads": int, "outside": [{"pid", "tid", "comm",
    "cpus_allowed", "last_cpu", "why"}]}``; ``why`` holds "allowed" (may run outside the
    CPUs) and/or "ran" (last ran outside them). Threads that end while being read are
    left out. This is what the post-check gates on (through ``rtfleet-drift --check --json``,
    checks.unit_threads).
    """
    inside = set(cpus)
    processes = threads = 0
    outside = []
    for pid in pids:
        task_dir = os.path.join(root, "proc", str(pid), "task")
        try:
            tids = sorted(int(t) for t in os.listdir(task_dir) if t.isdigit())
        except OSError:
            continue  # the process ended
        processes += 1
        for tid in tids:
            base = os.path.join(task_dir, str(tid))
            status = read_text(os.path.join(base, "status"))
            stat = read_text(os.path.join(base, "stat"))
            if status is None or stat is None:
                continue
            allowed_text = ""
            for line in status.splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    allowed_text = line.split(":", 1)[1].strip()
            try:
                allowed = set(parse_cpulist(allowed_text))
                comm, last_cpu = _task_stat(stat)
            except (TopologyError, ValueError, IndexError):
                continue
            threads += 1
            why = []
            if not allowed or allowed - inside:
                why.append("allowed")
            if last_cpu not in inside:
                why.append("ran")
            if why:
                outside.append(
                    {
                        "pid": pid,
                        "tid": tid,
                        "comm": comm,
                        "cpus_allowed": allowed_text,
                        "last_cpu": last_cpu,
                        "why": why,
                    }
                )
    return {"processes": processes, "threads": threads, "outside": outside}


def unit_threads(root, plan, units):
    """{unit: containment of its threads in its group} for every runtime group of the plan."""
    found = {}
    for group in plan.get("runtime_groups") or []:
        unit = unit_name(group)
        shown = units.get(unit, {})
        control_group = shown.get("ControlGroup") or ""
        pids = _cgroup_pids(root, control_group) if control_group else []
        report = thread_containment(root, pids, group["cpus"])
        report.update(
            group=group["name"],
            cpus=format_cpulist(group["cpus"]),
            active=shown.get("ActiveState") == "active",
        )
        found[unit] = report
    return found


def check_unit_threads(root, plan, units, runtime_installed):
    if not plan.get("runtime_groups"):
        return check_result("skipped", ["the plan has no runtime group"], units={})
    if not runtime_installed:
        return check_result(
            "skipped", ["shminfer@.service is not installed (runtime role not run)"], units={}
        )
    found = unit_threads(root, plan, units)
    problems = []
    for unit, report in found.items():
        if not report["threads"]:
            problems.append("%s has no threads to check (not running?)" % unit)
        for thread in report["outside"]:
            problems.append(
                "%s: thread %d (%s) of pid %d %s outside %s (allowed %s, last ran on CPU %d)"
                % (
                    unit,
                    thread["tid"],
                    thread["comm"],
                    thread["pid"],
                    " and ".join({"allowed": "may run", "ran": "ran"}[w] for w in thread["why"]),
                    report["cpus"],
                    thread["cpus_allowed"],
                    thread["last_cpu"],
                )
            )
    total = sum(r["threads"] for r in found.values())
    return judge(
        problems, ["%d threads of %d units inside their groups" % (total, len(found))], units=found
    )


_RESERVED = re.compile(r"""^reservedSystemCPUs:[ \t]*["']?([0-9,\- ]*)["']?[ \t]*$""", re.M)


def _reserved_cpus(text):
    """reservedSystemCPUs of a kubelet drop-in: JSON (what rtfleet_kubelet writes, after its
    comment header) or YAML with a top-level key; None when it sets none."""
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    try:
        config = json.loads(body)
    except ValueError:
        match = _RESERVED.search(text)
        return match.group(1).strip() if match else None
    value = config.get("reservedSystemCPUs") if isinstance(config, dict) else None
    return value if isinstance(value, str) else None


def check_kubelet(root, plan, dropin):
    """kubelet's reservedSystemCPUs in the rtfleet drop-in against the plan's; ``reserved``
    and ``planned`` hold both as written (the post-check's line)."""
    want = (plan.get("kubelet") or {}).get("reservedSystemCPUs")
    path = under(root, dropin)
    text = read_text(path)
    if text is None:
        return check_result(
            "skipped", ["no %s (kubelet role not run, or main-config mode)" % dropin]
        )
    if not want:
        return check_result("skipped", ["the plan has no kubelet reservedSystemCPUs"])
    have_text = _reserved_cpus(text)
    shown = {"reserved": have_text, "planned": want}
    if have_text is None:
        return check_result(
            "drift", ["%s sets no reservedSystemCPUs; the plan's is %s" % (dropin, want)], **shown
        )
    try:
        have = parse_cpulist(have_text.replace(" ", ""))
    except TopologyError as exc:
        return check_result("drift", ["%s: reservedSystemCPUs: %s" % (dropin, exc)], **shown)
    if have != parse_cpulist(want):
        return check_result(
            "drift",
            ["kubelet reservedSystemCPUs is %s, the plan's %s" % (have_text, want)],
            **shown,
        )
    return check_result("ok", ["reservedSystemCPUs %s" % want], **shown)
