"""The report's error and its files: host-safe names, whole files only, one writer at a time.

Every file the report writes (report.md, report.html, fleet.json, the plots) goes through
:func:`replacing`, so a reader never sees half a file, and :func:`report_lock` keeps two
report builds (the rollout's rescue on several hosts, two playbooks) from mixing their files.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
import time
from pathlib import Path


class ReportError(Exception):
    """Bad report input (no results, duplicate hosts) or a missing plotting library."""


def safe_name(host):
    return re.sub(r"[^A-Za-z0-9._-]", "_", host)


@contextlib.contextmanager
def replacing(path):
    """Yield a temporary path beside ``path``; it replaces ``path`` only when complete, so a
    reader (or a browser) never sees half a file."""
    # matplotlib picks the format from the suffix; nothing else may look like a result file
    suffix = ".png" if path.suffix == ".png" else ".part"
    fd, tmp = tempfile.mkstemp(prefix=".%s." % path.name, suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@contextlib.contextmanager
def report_lock(out_dir, timeout_s=300.0):
    """One writer of a report directory at a time: several failing hosts of a batch (the
    rollout's rescue path) or two playbooks may build the report at once."""
    with open(out_dir / ".report.lock", "a") as fh:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ReportError(
                        "%s is locked by another report writer for %ds" % (out_dir, timeout_s)
                    ) from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def write_text(path, text):
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


__all__ = ["ReportError", "replacing", "report_lock", "safe_name", "write_text"]
