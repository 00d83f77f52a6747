# Copyright: rtfleet contributors
# Apache-2.0
"""The drift guard: compare a running tuned host with the records the rtfleet roles left on it.

The implementation of ``rtfleet-drift`` (roles/rtfleet_host/files), installed by the
rtfleet_host role as /usr/local/lib/rtfleet/rtfleet_node/drift.py (with drift_checks.py,
drift_host.py and drift_units.py, which hold the checks; the role's files/rtfleet_node/ links
here) and run by
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
    checks.units adds "units": {UNIT: {"active": str, "cpu_affinity": str,
        "numa_policy": str, "numa_mask": str, "problems": [str, ...]}} (what systemctl
        showed of each unit of the plan; the post-check's lines come from it).
    checks.kubelet adds "reserved" and "planned" (reservedSystemCPUs as the drop-in and the
        plan write them) when there is a drop-in to read.
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
import socket
import subprocess
import sys
import tempfile
import time

from . import hosttune
from .drift_checks import CHECKS, read_text, under
from .drift_host import (
    check_cmdline,
    check_governor,
    check_hugepages,
    check_irqbalance,
    check_irqs,
    check_isolation,
    check_sysctls,
    check_tuned,
)
from .drift_units import check_kubelet, check_unit_threads, check_units, unit_name
from .plan_record import PLAN_FILE, PlanRecordError, check_plan

SCHEMA = 1
PLAN = PLAN_FILE
HOST = "/etc/rtfleet/host.json"
TUNE = "/etc/rtfleet/tune.json"
TUNE_STATE = "/run/rtfleet/tune-state.json"
RESULT = "/var/lib/rtfleet/drift.json"
LOCK = "/run/rtfleet/drift.lock"
TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"
TEXTFILE_NAME = "rtfleet_drift.prom"
KUBELET_DROPIN = "/etc/kubernetes/kubelet.conf.d/90-rtfleet.conf"
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
    plan_path, host_path, tune_path = (under(root, p) for p in (PLAN, HOST, TUNE))
    plan = _load_json(plan_path, "plan", ())
    host = _load_json(host_path, "host", ("kernel_args",))
    try:
        plan = check_plan(plan)
    except PlanRecordError as exc:
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
    wanted_units += [unit_name(g) for g in plan.get("runtime_groups") or []]
    units = systemctl_show(wanted_units, systemctl)
    # The runtime role's template unit: without it the runtime role has not run here.
    runtime_installed = os.path.exists(under(root, RUNTIME_TEMPLATE))
    previous = read_text(under(root, RESULT))
    try:
        unmovable_before = set(json.loads(previous)["checks"]["irqs"]["unmovable"])
    except (TypeError, ValueError, KeyError):
        unmovable_before = set()
    unmovable_before |= hosttune.read_unmovable(under(root, TUNE_STATE))
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
        return int(json.loads(read_text(under(root, RESULT)) or "{}").get("repinned_irqs_total", 0))
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
        sys.stderr.write("rtfleet-drift: --textfile-dir %s is not absolute\n" % args.textfile_dir)
        return 2
    try:
        records = load_records(args.root)
    except RecordError as exc:
        sys.stderr.write("rtfleet-drift: %s\n" % exc)
        return 2

    def log(message):
        sys.stderr.write("rtfleet-drift: %s\n" % message)

    lock = contextlib.nullcontext() if args.check else _lock(under(args.root, LOCK))
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
                under(args.root, RESULT), json.dumps(result, indent=2, sort_keys=True) + "\n"
            )
            write_atomic(
                os.path.join(under(args.root, args.textfile_dir), TEXTFILE_NAME),
                render_textfile(result),
            )
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2, sort_keys=True) + "\n")
    else:  # the journal of every timer run: what is not ok, then one summary line
        for name in CHECKS:
            entry = result["checks"][name]
            if entry["status"] in ("drift", "repaired"):
                for detail in entry["details"] or [""]:
                    sys.stdout.write("%-12s %-8s %s\n" % (name, entry["status"], detail))
        drifted = [n for n in CHECKS if result["checks"][n]["status"] == "drift"]
        sys.stdout.write(
            "rtfleet-drift: %s (%s)\n"
            % (
                "drift in %s" % ", ".join(drifted) if drifted else "no drift",
                "checked only" if args.check else "%d IRQs re-pinned" % len(repinned),
            )
        )
    return result["exit_code"]
