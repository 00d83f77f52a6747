# Copyright: rtfleet contributors
# Apache-2.0
"""The drift guard's checks of the host itself: command line, isolation, IRQs, irqbalance,
tuned, sysctls, hugepages and governor (each documented in drift.py). Stdlib only."""

from __future__ import annotations

import os
import re

from . import boot, hosttune
from .cpulist import TopologyError, format_cpulist, parse_cpulist, parse_cpumask
from .drift_checks import check_result, judge, read_text, under

IRQBALANCE_CONFIG = "/etc/default/irqbalance"
TUNED_ACTIVE = "/etc/tuned/active_profile"


def check_cmdline(root, host):
    running = boot.read_running(root)
    missing = [a for a in host["kernel_args"] if a not in set(running["args"])]
    if missing:
        return check_result("drift", ["/proc/cmdline lacks %s" % " ".join(missing)])
    return check_result("ok", ["%d rtfleet arguments present" % len(host["kernel_args"])])


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
    return judge(
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
        text = read_text(os.path.join(root, "proc/irq", str(irq), "effective_affinity_list"))
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
    return check_result(
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
        return judge(
            problems,
            ["irq_mode static: irqbalance %s" % ("stopped" if installed else "not installed")],
        )
    want = set(plan.get("isolated") or [])
    if isinstance(plan.get("irqbalance_banned_cpus"), str):
        want = set(parse_cpulist(plan["irqbalance_banned_cpus"]))
    problems = []
    if not installed:
        return check_result(
            "drift", ["irq_mode irqbalance but irqbalance.service is not installed"]
        )
    if not active:
        problems.append("irqbalance is not running (irq_mode irqbalance)")
    config_path = under(root, IRQBALANCE_CONFIG)
    try:
        banned = _banned(read_text(config_path), config_path)
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
        environ = read_text(os.path.join(root, "proc", pid, "environ"))
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
    return judge(problems, ["irqbalance running, banning %s" % format_cpulist(sorted(want))])


def check_tuned(root, host, units):
    profile = host.get("tuned_profile")
    if not profile:
        return check_result(
            "skipped", ["no tuned profile in host.json (kernel flavour without tuned)"]
        )
    problems = []
    active = read_text(under(root, TUNED_ACTIVE))
    if active != profile:
        problems.append("the active tuned profile is %r, host.json says %r" % (active, profile))
    if units.get("tuned.service", {}).get("ActiveState") != "active":
        problems.append("tuned.service is not running")
    return judge(problems, ["tuned profile %s active" % profile])


def check_sysctls(root, tune):
    out = {"skipped": []}
    drifted = hosttune.sysctl_drift(root, tune[0].get("sysctls") or {}, out)
    problems = ["%s is %s, wanted %s" % item for item in drifted]
    return judge(
        problems, out["skipped"] or ["%d sysctls as recorded" % len(tune[0].get("sysctls") or {})]
    )


def check_hugepages(root, tune):
    if not tune[3]:
        return check_result("skipped", ["no per-node hugepages in tune.json"])
    size_kb, per_node = tune[3]
    out = {"skipped": []}
    drifted = hosttune.hugepage_drift(root, size_kb, per_node, out)
    problems = [
        "node %d has %d x %d kB pages, wanted %d" % (n, have, size_kb, want)
        for n, have, want in drifted
    ]
    return judge(problems + out["skipped"], ["%d nodes as recorded" % len(per_node)])


def check_governor(root, tune):
    governor = tune[0].get("governor")
    if not governor:
        return check_result("skipped", ["no governor in tune.json"])
    out = {"changed": [], "skipped": []}
    hosttune.tune_governor(root, governor, True, out)
    if out["changed"]:
        return check_result("drift", ["%s (wanted)" % c for c in out["changed"]])
    if any("no cpufreq driver" in s for s in out["skipped"]):
        return check_result("skipped", out["skipped"])
    return check_result("ok", ["governor %s" % governor] + out["skipped"])
