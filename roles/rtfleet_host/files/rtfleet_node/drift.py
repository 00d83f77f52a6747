# Copyright: rtfleet contributors
# Apache-2.0
"""The drift guard: compare a running tuned host with the records the rtfleet roles left on it.

The implementation of ``rtfleet-drift`` (roles/rtfleet_host/files), installed by the
rtfleet_host role as /usr/local/lib/rtfleet/rtfleet_node/drift.py and run by
``rtfleet-drift.timer`` (every ``rtfleet_host_drift_interval_s``) and on demand
(``playbooks/verify.yml``). Stdlib only, Python >= 3.9.

Records read (all below ``--root``, ``/`` on a host): /etc/rtfleet/plan.json (the plan),
/etc/rtfleet/host.json (kernel arguments, IRQ mode, tuned profile), /etc/rtfleet/tune.json
(housekeeping CPUs, sysctls, hugepages per node), /run/rtfleet/tune-state.json (IRQs the
tuner found unmovable), the kubelet drop-in and /etc/default/irqbalance.

Checks, each ``ok``, ``drift``, ``repaired`` or ``skipped`` (with its reasons):

    cmdline       every argument of host.json's kernel_args is in /proc/cmdline
    isolation     /sys/devices/system/cpu/{isolated,nohz_full} are what those arguments give
    irqs          every IRQ's smp_affinity_list and effective_affinity_list (IRQs that
                  appeared after boot included) and default_smp_affinity on housekeeping
                  CPUs; moved IRQs are re-pinned with rtfleet-host-tune's own code
                  (``repaired``); IRQs the kernel refuses to move (per-CPU, managed) are
                  listed as ``unmovable``, not drift
    irqbalance    irq_mode static: irqbalance neither running nor enabled; irq_mode
                  irqbalance: running, with the plan's isolated CPUs banned in its config
                  and in the environment of the running daemon
    tuned         the active tuned profile is host.json's tuned_profile (skipped without one)
    sysctls       every sysctl of tune.json
    hugepages     each NUMA node's pool of tune.json's page size
    governor      every CPU's cpufreq governor (skipped without cpufreq)
    units         each shminfer@<group> unit active, its CPUAffinity the group's CPUs and its
                  NUMA policy bind to the group's memory node (systemctl show)
    unit_threads  every thread of every process of each unit (its cgroup, sub-cgroups
                  included) allowed only on the group's CPUs (Cpus_allowed_list) and last run
                  on one of them (field 39 of /proc/PID/task/TID/stat):
                  :func:`unit_threads` / :func:`thread_containment`
    kubelet       reservedSystemCPUs in the kubelet drop-in is the plan's (skipped without it)

Only IRQs are changed (and nothing with ``--check``); everything else is reported. Each
run (without ``--check``) writes, atomically (temporary file + rename in the same
directory), the JSON result to /var/lib/rtfleet/drift.json and the Prometheus textfile
``rtfleet_drift.prom`` into ``--textfile-dir`` for node_exporter's textfile collector.

The JSON document (``--json`` prints it; schema 1, keys stable):

    {"schema": 1, "tool": "rtfleet-drift", "host": str, "checked_at": "...Z",
     "timestamp": float, "mode": "check" | "repair", "drift": bool, "exit_code": 0 | 1,
     "repinned_irqs_total": int,
     "checks": {NAME: {"status": "ok" | "drift" | "repaired" | "skipped",
                       "details": [str, ...], ...}}}

    checks.irqs adds "repinned" and "would_repin" ([{"irq", "actions", "from", "to"}]),
    "unmovable" ([int]) and "effective_outside" ([{"irq", "actions", "effective"}]).
    checks.unit_threads adds "units": {UNIT: {"group": str, "cpus": cpulist,
        "active": bool, "processes": int, "threads": int,
        "outside": [{"pid": int, "tid": int, "comm": str, "cpus_allowed": cpulist,
                     "last_cpu": int, "why": ["allowed" and/or "ran"]}]}}

Exit codes: 0 no drift left (IRQs it re-pinned are logged and counted, not an error), 1
drift found that it did not repair (with ``--check``: any drift), 2 a record is missing or
unreadable (one line on stderr naming the file; nothing is written).
"""

import argparse
import contextlib
import datetime
import fcntl
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

from . import boot, hosttune
from .drift_checks import CHECKS
from .topology import TopologyError, format_cpulist, parse_cpulist, parse_cpumask

SCHEMA = 1
PLAN = "/etc/rtfleet/plan.json"
HOST = "/etc/rtfleet/host.json"
TUNE = "/etc/rtfleet/tune.json"
TUNE_STATE = "/run/rtfleet/tune-state.json"
RESULT = "/var/lib/rtfleet/drift.json"
LOCK = "/run/rtfleet/drift.lock"
TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"
TEXTFILE_NAME = "rtfleet_drift.prom"
KUBELET_DROPIN = "/etc/kubernetes/kubelet.conf.d/90-rtfleet.conf"
IRQBALANCE_CONFIG = "/etc/default/irqbalance"
TUNED_ACTIVE = "/etc/tuned/active_profile"
RUNTIME_TEMPLATE = "/etc/systemd/system/shminfer@.service"
UNIT_PROPERTIES = (
    "Id",
    "LoadState",
    "ActiveState",
    "UnitFileState",
    "MainPID",
    "ControlGroup",
    "CPUAffinity",
    "NUMAPolicy",
    "NUMAMask",
)


class RecordError(Exception):
    """A record the guard needs is missing or malformed; the message names the file."""


def _under(root, path):
    return os.path.join(root, path.lstrip("/"))


def _read(path, default=None):
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read().replace("\x00", "").strip()
    except OSError:
        return default


def _cpus(text):
    """systemctl prints cpusets space-separated ("0-1 12-13"); files use commas."""
    return parse_cpulist(",".join((text or "").split()))


def _load_json(path, name, required_keys):
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise RecordError("cannot use %s: %s" % (path, exc)) from None
    if not isinstance(data, dict):
        raise RecordError("cannot use %s: the %s record is not a JSON object" % (path, name))
    missing = [k for k in required_keys if k not in data]
    if missing:
        raise RecordError(
            "cannot use %s: no %s in the %s record" % (path, ", ".join(missing), name)
        )
    return data


def load_records(root):
    """(plan, host record, tune config tuple) or RecordError naming the file."""
    plan_path, host_path, tune_path = (_under(root, p) for p in (PLAN, HOST, TUNE))
    plan = _load_json(plan_path, "plan", ("housekeeping", "isolated", "runtime_groups"))
    host = _load_json(host_path, "host", ("kernel_args",))
    try:
        for key in ("housekeeping", "isolated"):
            if not isinstance(plan[key], list) or not all(isinstance(c, int) for c in plan[key]):
                raise ValueError("%s is not a list of CPU numbers" % key)
        if not isinstance(plan["runtime_groups"], list):
            raise ValueError("runtime_groups is not a list")
        for group in plan["runtime_groups"]:
            if not isinstance(group, dict) or not {"name", "cpus"} <= set(group):
                raise ValueError("a runtime group without name or cpus")
            if not all(isinstance(c, int) for c in group["cpus"]):
                raise ValueError(
                    "runtime group %s: cpus is not a list of CPU numbers" % group["name"]
                )
    except (TypeError, ValueError) as exc:
        raise RecordError("cannot use %s: %s" % (plan_path, exc)) from None
    if not isinstance(host["kernel_args"], list) or not all(
        isinstance(a, str) for a in host["kernel_args"]
    ):
        raise RecordError("cannot use %s: kernel_args is not a list of strings" % host_path)
    try:
        tune = hosttune.load_config(tune_path)
    except hosttune.ConfigError as exc:
        raise RecordError(str(exc)) from None
    return plan, host, tune


# --------------------------------------------------------------------------- systemctl


def systemctl_show(units, systemctl="systemctl"):
    """{unit: {property: value}} from one ``systemctl show`` of every unit."""
    if not units:
        return {}
    argv = [systemctl, "show", "--property=" + ",".join(UNIT_PROPERTIES), "--", *units]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    shown = {}
    for block in out.split("\n\n"):
        props = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if props.get("Id"):
            shown[props["Id"]] = props
    # systemctl names an unknown unit by the name asked for; anything missing is unknown too.
    return {u: shown.get(u, {"Id": u, "LoadState": "not-found"}) for u in units}


# --------------------------------------------------------------------------- checks


def _result(status="ok", details=None, **extra):
    out = {"status": status, "details": list(details or [])}
    out.update(extra)
    return out


def _judge(problems, ok_details=None, **extra):
    return _result("drift" if problems else "ok", problems or ok_details, **extra)


def check_cmdline(root, host):
    running = boot.read_running(root)
    missing = [a for a in host["kernel_args"] if a not in set(running["args"])]
    if missing:
        return _result("drift", ["/proc/cmdline lacks %s" % " ".join(missing)])
    return _result("ok", ["%d rtfleet arguments present" % len(host["kernel_args"])])


def check_isolation(root, host, plan):
    running = boot.read_running(root)
    expected = boot.isolation_expected(host["kernel_args"])
    problems = []
    for key in ("isolated", "nohz_full"):
        have = running[key]
        if have is not None and have != expected[key]:
            problems.append(
                "/sys/devices/system/cpu/%s is %r, the plan says %r" % (key, have, expected[key])
            )
    if expected["nohz_full"] and parse_cpulist(expected["nohz_full"]) != sorted(plan["isolated"]):
        problems.append(
            "host.json's nohz_full=%s is not the plan's isolated CPUs %s"
            % (expected["nohz_full"], format_cpulist(plan["isolated"]))
        )
    return _judge(
        problems, ["isolated %r, nohz_full %r" % (expected["isolated"], expected["nohz_full"])]
    )


def check_irqs(root, tune, check, unmovable_before, log):
    """IRQs off the housekeeping CPUs, re-pinned (unless ``check``) by the tuner's code."""
    _config, housekeeping, mask, _hugepages = tune
    wanted = set(parse_cpulist(housekeeping))
    out = {"changed": [], "unmovable": [], "skipped": [], "short": []}
    moves = hosttune.tune_irqs(root, housekeeping, mask, check, out, unmovable_before)
    named = []
    for move in moves:
        entry = dict(move)
        entry["actions"] = (
            [] if move["irq"] == "default" else hosttune.irq_actions(root, move["irq"])
        )
        named.append(entry)
        if not check:
            log(
                "re-pinned %s%s from %s to %s"
                % (
                    "default_smp_affinity" if move["irq"] == "default" else "IRQ %d" % move["irq"],
                    " (%s)" % ", ".join(entry["actions"]) if entry["actions"] else "",
                    move["from"],
                    move["to"],
                )
            )
    unmovable = sorted(set(out["unmovable"]))
    # The kernel's choice within the allowed CPUs; outside housekeeping while the allowed set
    # is inside means the kernel could not honour it (a managed IRQ): drift, not re-pinnable.
    effective_outside = []
    for irq in hosttune.irq_numbers(root):
        if irq in unmovable or irq in unmovable_before:
            continue
        text = _read(os.path.join(root, "proc/irq", str(irq), "effective_affinity_list"))
        if not text:
            continue
        try:
            effective = set(parse_cpulist(text))
        except TopologyError:
            continue
        if effective - wanted:
            effective_outside.append(
                {"irq": irq, "actions": hosttune.irq_actions(root, irq), "effective": text}
            )
    details = []
    for move in named:
        what = "default_smp_affinity" if move["irq"] == "default" else "IRQ %d" % move["irq"]
        label = " (%s)" % ", ".join(move["actions"]) if move["actions"] else ""
        verb = "would re-pin" if check else "re-pinned"
        details.append("%s%s on %s: %s to %s" % (what, label, move["from"], verb, move["to"]))
    for item in effective_outside:
        details.append(
            "IRQ %d effective affinity %s is outside housekeeping %s"
            % (item["irq"], item["effective"], housekeeping)
        )
    if unmovable:
        details.append(
            "unmovable (per-CPU or managed, the kernel refuses to move them): %s"
            % ", ".join(map(str, unmovable))
        )
    if check:
        status = "drift" if moves or effective_outside else "ok"
    elif effective_outside:
        status = "drift"
    else:
        status = "repaired" if moves else "ok"
    if status == "ok" and not details:
        details = ["%d IRQs on housekeeping %s" % (len(hosttune.irq_numbers(root)), housekeeping)]
    return _result(
        status,
        details,
        repinned=[] if check else named,
        would_repin=named if check else [],
        unmovable=unmovable,
        effective_outside=effective_outside,
    )


def _env_value(text, key):
    """KEY=value from a shell-style config (last assignment wins) or a NUL-separated environ."""
    value = None
    for raw in re.split(r"[\n\x00]", text or ""):
        line = raw.strip()
        if line.startswith("export "):
            line = line[len("export ") :].strip()
        if line.startswith(key + "="):
            value = line[len(key) + 1 :].strip().strip("\"'")
    return value


def _banned(text, where):
    """The CPUs an irqbalance config or environment bans (cpulist or hex mask), or None."""
    cpulist = _env_value(text, "IRQBALANCE_BANNED_CPULIST")
    if cpulist is not None:
        return set(parse_cpulist(cpulist))
    mask = _env_value(text, "IRQBALANCE_BANNED_CPUS")
    if mask is not None:
        return set(parse_cpumask(mask, where))
    return None


def check_irqbalance(root, tune, plan, units):
    mode = tune[0].get("irq_mode") or "static"
    shown = units.get("irqbalance.service", {})
    installed = shown.get("LoadState") not in (None, "not-found")
    active = shown.get("ActiveState") in ("active", "activating", "reloading")
    enabled = shown.get("UnitFileState") in ("enabled", "enabled-runtime")
    if mode == "static":
        problems = []
        if active:
            problems.append(
                "irqbalance is running; irq_mode static stopped it, and it moves IRQs "
                "onto isolated CPUs"
            )
        if enabled:
            problems.append("irqbalance.service is enabled: it would start at the next boot")
        return _judge(
            problems,
            ["irq_mode static: irqbalance %s" % ("stopped" if installed else "not installed")],
        )
    want = set(plan.get("isolated") or [])
    if isinstance(plan.get("irqbalance_banned_cpus"), str):
        want = set(parse_cpulist(plan["irqbalance_banned_cpus"]))
    problems = []
    if not installed:
        return _result("drift", ["irq_mode irqbalance but irqbalance.service is not installed"])
    if not active:
        problems.append("irqbalance is not running (irq_mode irqbalance)")
    config_path = _under(root, IRQBALANCE_CONFIG)
    try:
        banned = _banned(_read(config_path), config_path)
    except TopologyError as exc:
        banned = None
        problems.append("%s: %s" % (config_path, exc))
    if banned != want:
        problems.append(
            "%s bans %s, the plan's isolated CPUs are %s"
            % (
                IRQBALANCE_CONFIG,
                "nothing" if banned is None else format_cpulist(sorted(banned)) or "nothing",
                format_cpulist(sorted(want)),
            )
        )
    pid = shown.get("MainPID") or "0"
    if active and pid.isdigit() and int(pid) > 0:
        environ = _read(os.path.join(root, "proc", pid, "environ"))
        if environ is not None:
            try:
                running = _banned(environ, "/proc/%s/environ" % pid)
            except TopologyError:
                running = None
            if running != want:
                problems.append(
                    "the running irqbalance (pid %s) bans %s: restart it to ban %s"
                    % (
                        pid,
                        "nothing" if not running else format_cpulist(sorted(running)),
                        format_cpulist(sorted(want)),
                    )
                )
    return _judge(problems, ["irqbalance running, banning %s" % format_cpulist(sorted(want))])


def check_tuned(root, host, units):
    profile = host.get("tuned_profile")
    if not profile:
        return _result("skipped", ["no tuned profile in host.json (kernel flavour without tuned)"])
    problems = []
    active = _read(_under(root, TUNED_ACTIVE))
    if active != profile:
        problems.append("the active tuned profile is %r, host.json says %r" % (active, profile))
    if units.get("tuned.service", {}).get("ActiveState") != "active":
        problems.append("tuned.service is not running")
    return _judge(problems, ["tuned profile %s active" % profile])


def check_sysctls(root, tune):
    out = {"skipped": []}
    drifted = hosttune.sysctl_drift(root, tune[0].get("sysctls") or {}, out)
    problems = ["%s is %s, wanted %s" % item for item in drifted]
    return _judge(
        problems, out["skipped"] or ["%d sysctls as recorded" % len(tune[0].get("sysctls") or {})]
    )


def check_hugepages(root, tune):
    if not tune[3]:
        return _result("skipped", ["no per-node hugepages in tune.json"])
    size_kb, per_node = tune[3]
    out = {"skipped": []}
    drifted = hosttune.hugepage_drift(root, size_kb, per_node, out)
    problems = [
        "node %d has %d x %d kB pages, wanted %d" % (n, have, size_kb, want)
        for n, have, want in drifted
    ]
    return _judge(problems + out["skipped"], ["%d nodes as recorded" % len(per_node)])


def check_governor(root, tune):
    governor = tune[0].get("governor")
    if not governor:
        return _result("skipped", ["no governor in tune.json"])
    out = {"changed": [], "skipped": []}
    hosttune.tune_governor(root, governor, True, out)
    if out["changed"]:
        return _result("drift", ["%s (wanted)" % c for c in out["changed"]])
    if any("no cpufreq driver" in s for s in out["skipped"]):
        return _result("skipped", out["skipped"])
    return _result("ok", ["governor %s" % governor] + out["skipped"])


def _unit_name(group):
    return "shminfer@%s.service" % group["name"]


def _memory_node(group):
    return group.get("memory_node", group.get("numa_node"))


def check_units(plan, units, runtime_installed):
    groups = plan.get("runtime_groups") or []
    if not groups:
        return _result("skipped", ["the plan has no runtime group"])
    if not runtime_installed:
        return _result("skipped", ["shminfer@.service is not installed (runtime role not run)"])
    problems = []
    for group in groups:
        unit = _unit_name(group)
        shown = units.get(unit, {})
        if shown.get("ActiveState") != "active":
            problems.append("%s is %s" % (unit, shown.get("ActiveState") or shown.get("LoadState")))
            continue
        have = _cpus(shown.get("CPUAffinity"))
        if have != sorted(group["cpus"]):
            problems.append(
                "%s CPUAffinity is %s, the plan's group %s"
                % (unit, format_cpulist(have) or "unset", format_cpulist(group["cpus"]))
            )
        mask = _cpus(shown.get("NUMAMask"))
        node = _memory_node(group)
        if node is not None and (shown.get("NUMAPolicy") != "bind" or mask != [node]):
            problems.append(
                "%s NUMA policy is %s:%s, the plan's bind:%s"
                % (unit, shown.get("NUMAPolicy") or "default", format_cpulist(mask), node)
            )
    return _judge(problems, ["%d units pinned and bound as planned" % len(groups)])


def _cgroup_pids(root, control_group):
    """Every process of a unit's cgroup and of the cgroups below it."""
    base = os.path.join(root, "sys/fs/cgroup", control_group.lstrip("/"))
    pids = set()
    for dirpath, _dirs, files in os.walk(base):
        if "cgroup.procs" in files:
            text = _read(os.path.join(dirpath, "cgroup.procs")) or ""
            pids.update(int(p) for p in text.split() if p.isdigit())
    return sorted(pids)


def _task_stat(text):
    """(comm, last-run CPU) from /proc/PID/task/TID/stat; comm may hold spaces and ')'."""
    head, _, tail = text.rpartition(")")
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
            status = _read(os.path.join(base, "status"))
            stat = _read(os.path.join(base, "stat"))
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
        unit = _unit_name(group)
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
        return _result("skipped", ["the plan has no runtime group"], units={})
    if not runtime_installed:
        return _result(
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
    return _judge(
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
    want = (plan.get("kubelet") or {}).get("reservedSystemCPUs")
    path = _under(root, dropin)
    text = _read(path)
    if text is None:
        return _result("skipped", ["no %s (kubelet role not run, or main-config mode)" % dropin])
    if not want:
        return _result("skipped", ["the plan has no kubelet reservedSystemCPUs"])
    have_text = _reserved_cpus(text)
    if have_text is None:
        return _result(
            "drift", ["%s sets no reservedSystemCPUs; the plan's is %s" % (dropin, want)]
        )
    try:
        have = parse_cpulist(have_text.replace(" ", ""))
    except TopologyError as exc:
        return _result("drift", ["%s: reservedSystemCPUs: %s" % (dropin, exc)])
    if have != parse_cpulist(want):
        return _result(
            "drift", ["kubelet reservedSystemCPUs is %s, the plan's %s" % (have_text, want)]
        )
    return _result("ok", ["reservedSystemCPUs %s" % want])


# --------------------------------------------------------------------------- outputs


def _esc(value):
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_textfile(result):
    """Prometheus text exposition (node_exporter's textfile collector) of one run."""
    lines = [
        "# HELP rtfleet_drift 1 when the host differs from rtfleet's records in this check "
        "(after IRQs were re-pinned), else 0 (also for a check that does not apply).",
        "# TYPE rtfleet_drift gauge",
    ]
    for name in CHECKS:
        status = result["checks"][name]["status"]
        lines.append('rtfleet_drift{check="%s"} %d' % (_esc(name), status == "drift"))
    irqs = result["checks"]["irqs"]
    lines += [
        "# HELP rtfleet_drift_repinned_irqs_total IRQs rtfleet-drift moved back to the "
        "housekeeping CPUs.",
        "# TYPE rtfleet_drift_repinned_irqs_total counter",
        "rtfleet_drift_repinned_irqs_total %d" % result["repinned_irqs_total"],
        "# HELP rtfleet_drift_unmovable_irqs IRQs the kernel refuses to move (per-CPU or "
        "managed); not drift.",
        "# TYPE rtfleet_drift_unmovable_irqs gauge",
        "rtfleet_drift_unmovable_irqs %d" % len(irqs.get("unmovable") or []),
        "# HELP rtfleet_drift_unit_threads_outside Threads of a shminfer unit allowed or "
        "last run outside its CPU group.",
        "# TYPE rtfleet_drift_unit_threads_outside gauge",
    ]
    for unit, report in sorted((result["checks"]["unit_threads"].get("units") or {}).items()):
        lines.append(
            'rtfleet_drift_unit_threads_outside{unit="%s"} %d'
            % (_esc(unit), len(report["outside"]))
        )
    lines += [
        "# HELP rtfleet_check_last_success_timestamp_seconds Unix time of the last run of an "
        "rtfleet check that could read its records and the host.",
        "# TYPE rtfleet_check_last_success_timestamp_seconds gauge",
        'rtfleet_check_last_success_timestamp_seconds{tool="rtfleet-drift"} %.3f'
        % result["timestamp"],
    ]
    return "\n".join(lines) + "\n"


def write_atomic(path, text, mode=0o644):
    """Replace ``path`` with ``text`` in one rename: a reader sees the old or the new file."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    # node_exporter reads only *.prom: the temporary name must not end in it.
    fd, tmp = tempfile.mkstemp(
        prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory
    )
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@contextlib.contextmanager
def _lock(path):
    """One repairing run at a time (the timer and verify.yml may meet)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- entry point


def run_checks(
    root, records, check, *, kubelet_dropin=KUBELET_DROPIN, systemctl="systemctl", log=None
):
    """The result document (without the counter) for one run over a host (or a tree)."""
    plan, host, tune = records
    log = log or (lambda message: None)
    wanted_units = ["irqbalance.service", "tuned.service"]
    wanted_units += [_unit_name(g) for g in plan.get("runtime_groups") or []]
    units = systemctl_show(wanted_units, systemctl)
    # The runtime role's template unit: without it the runtime role has not run here.
    runtime_installed = os.path.exists(_under(root, RUNTIME_TEMPLATE))
    previous = _read(_under(root, RESULT))
    try:
        unmovable_before = set(json.loads(previous)["checks"]["irqs"]["unmovable"])
    except (TypeError, ValueError, KeyError):
        unmovable_before = set()
    unmovable_before |= hosttune.read_unmovable(_under(root, TUNE_STATE))
    checks = {
        "cmdline": check_cmdline(root, host),
        "isolation": check_isolation(root, host, plan),
        "irqs": check_irqs(root, tune, check, unmovable_before, log),
        "irqbalance": check_irqbalance(root, tune, plan, units),
        "tuned": check_tuned(root, host, units),
        "sysctls": check_sysctls(root, tune),
        "hugepages": check_hugepages(root, tune),
        "governor": check_governor(root, tune),
        "units": check_units(plan, units, runtime_installed),
        "unit_threads": check_unit_threads(root, plan, units, runtime_installed),
        "kubelet": check_kubelet(root, plan, kubelet_dropin),
    }
    drift = any(c["status"] == "drift" for c in checks.values())
    now = time.time()
    return {
        "schema": SCHEMA,
        "tool": "rtfleet-drift",
        "host": socket.gethostname(),
        "checked_at": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%SZ"
        ),
        "timestamp": round(now, 3),
        "mode": "check" if check else "repair",
        "drift": drift,
        "exit_code": 1 if drift else 0,
        "checks": checks,
    }


def _previous_total(root):
    try:
        return int(json.loads(_read(_under(root, RESULT)) or "{}").get("repinned_irqs_total", 0))
    except (TypeError, ValueError, AttributeError):
        return 0


def main(argv=None, systemctl="systemctl"):
    ap = argparse.ArgumentParser(
        prog="rtfleet-drift", description=__doc__.split("\n\n", maxsplit=1)[0].strip()
    )
    ap.add_argument(
        "--check", action="store_true", help="report only: re-pin nothing, write nothing"
    )
    ap.add_argument("--json", action="store_true", help="print the result document (schema 1)")
    ap.add_argument(
        "--textfile-dir",
        default=TEXTFILE_DIR,
        help="node_exporter textfile collector directory (default %(default)s)",
    )
    ap.add_argument("--kubelet-dropin", default=KUBELET_DROPIN, help="default %(default)s")
    ap.add_argument(
        "--root", default="/", help="a whole host tree (tests); every path is read below it"
    )
    ap.add_argument("--systemctl", default=systemctl, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not os.path.isabs(args.textfile_dir):
        print(
            "rtfleet-drift: --textfile-dir %s is not absolute" % args.textfile_dir, file=sys.stderr
        )
        return 2
    try:
        records = load_records(args.root)
    except RecordError as exc:
        print("rtfleet-drift: %s" % exc, file=sys.stderr)
        return 2

    def log(message):
        print("rtfleet-drift: %s" % message, file=sys.stderr)

    lock = contextlib.nullcontext() if args.check else _lock(_under(args.root, LOCK))
    with lock:
        result = run_checks(
            args.root,
            records,
            args.check,
            kubelet_dropin=args.kubelet_dropin,
            systemctl=args.systemctl,
            log=log,
        )
        repinned = [m for m in result["checks"]["irqs"]["repinned"] if m["irq"] != "default"]
        result["repinned_irqs_total"] = _previous_total(args.root) + len(repinned)
        if not args.check:
            write_atomic(
                _under(args.root, RESULT), json.dumps(result, indent=2, sort_keys=True) + "\n"
            )
            write_atomic(
                os.path.join(_under(args.root, args.textfile_dir), TEXTFILE_NAME),
                render_textfile(result),
            )
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:  # the journal of every timer run: what is not ok, then one summary line
        for name in CHECKS:
            entry = result["checks"][name]
            if entry["status"] in ("drift", "repaired"):
                for detail in entry["details"] or [""]:
                    print("%-12s %-8s %s" % (name, entry["status"], detail))
        drifted = [n for n in CHECKS if result["checks"][n]["status"] == "drift"]
        print(
            "rtfleet-drift: %s (%s)"
            % (
                "drift in %s" % ", ".join(drifted) if drifted else "no drift",
                "checked only" if args.check else "%d IRQs re-pinned" % len(repinned),
            )
        )
    return result["exit_code"]
