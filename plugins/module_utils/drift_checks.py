# Copyright: rtfleet contributors
# Apache-2.0
"""The drift guard's checks, by name, in the order it runs and reports them, and the ground
floor they stand on: the shape of a check's result and how they read a host's files.

Shared by rtfleet-drift on a node (drift.py, which documents each check, with drift_host.py
and drift_units.py) and the fleet report's drift section (report_drift.py). Stdlib only.
"""

from __future__ import annotations

import os

from .cpulist import parse_cpulist

CHECKS = (
    "cmdline",
    "isolation",
    "irqs",
    "irqbalance",
    "tuned",
    "sysctls",
    "hugepages",
    "governor",
    "units",
    "unit_threads",
    "kubelet",
)


def under(root, path):
    return os.path.join(root, path.lstrip("/"))


def read_text(path, default=None):
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read().replace("\x00", "").strip()
    except OSError:
        return default


def systemd_cpus(text):
    """systemctl prints cpusets space-separated ("0-1 12-13"); files use commas."""
    return parse_cpulist(",".join((text or "").split()))


def check_result(status="ok", details=None, **extra):
    out = {"status": status, "details": list(details or [])}
    out.update(extra)
    return out


def judge(problems, ok_details=None, **extra):
    return check_result("drift" if problems else "ok", problems or ok_details, **extra)
