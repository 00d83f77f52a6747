"""A worker process's surroundings: its JSON event lines on stderr (journald keeps them),
its scheduling policy, the parent-death signal, its thread count."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time


def log_event(event: str, **fields) -> None:
    """One JSON line on stderr (journald keeps it); the structured slow_infer events."""
    sys.stderr.write(json.dumps({"event": event, "ts": round(time.time(), 6), **fields}) + "\n")
    sys.stderr.flush()


class SchedPolicy:
    """SCHED_FIFO while inferring ("infer"), always ("always") or never ("off")."""

    def __init__(self, mode: str, priority: int):
        self.mode = mode
        self.priority = priority
        self.enabled = False
        if mode == "off":
            return
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
            self.enabled = True
        except PermissionError:
            log_event(
                "sched_fifo_unavailable",
                reason="needs CAP_SYS_NICE or RLIMIT_RTPRIO >= %d; running SCHED_OTHER" % priority,
            )
            return
        if mode == "infer":
            self.idle()

    def busy(self):
        if self.enabled and self.mode == "infer":
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(self.priority))

    def idle(self):
        if self.enabled and self.mode == "infer":
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def _die_with_parent():
    """PR_SET_PDEATHSIG: the kernel kills this worker if the supervisor dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def threading_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1
