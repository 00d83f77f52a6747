"""Thin Linux system-call wrappers: futex, mbind, process identity.

ctypes over libc's syscall(2), so the runtime needs no compiler on the node. Numbers are
per-architecture; x86_64 and aarch64 are supported.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long

_MACHINE = platform.machine()
_NR = {
    "x86_64": {"futex": 202, "mbind": 237},
    "aarch64": {"futex": 98, "mbind": 235},
}.get(_MACHINE)

FUTEX_WAIT = 0
FUTEX_WAKE = 1
MPOL_PREFERRED = 1
MPOL_BIND = 2
MPOL_MF_STRICT = 1
MPOL_MF_MOVE = 2


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


def _require(name):
    if _NR is None:
        raise OSError(errno.ENOSYS, f"shminfer: no {name} syscall number for {_MACHINE}")
    return _NR[name]


def futex_wait(address: int, expected: int, timeout_s: float | None) -> bool:
    """Block while the u32 at ``address`` equals ``expected``. False on timeout.

    Shared (not FUTEX_PRIVATE) so it works across processes mapping the same file.
    """
    if timeout_s is None:
        ts = None
    else:
        timeout_s = max(timeout_s, 0.0)
        ts = ctypes.byref(_Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9)))
    ret = _syscall(
        _require("futex"),
        ctypes.c_void_p(address),
        FUTEX_WAIT,
        ctypes.c_uint32(expected),
        ts,
        None,
        0,
    )
    if ret == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EAGAIN, errno.EINTR):
        return True
    if err == errno.ETIMEDOUT:
        return False
    raise OSError(err, "futex wait: " + os.strerror(err))


def futex_wake(address: int, count: int = 2**31 - 1) -> int:
    ret = _syscall(_require("futex"), ctypes.c_void_p(address), FUTEX_WAKE, count, None, None, 0)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, "futex wake: " + os.strerror(err))
    return ret


def mbind(address: int, length: int, node: int, mode: int = MPOL_BIND) -> None:
    """Bind the pages of [address, address+length) to one NUMA node (before first touch)."""
    bits = ctypes.c_ulong * (node // 64 + 1)
    mask = bits()
    mask[node // 64] = 1 << (node % 64)
    ret = _syscall(
        _require("mbind"),
        ctypes.c_void_p(address),
        ctypes.c_ulong(length),
        mode,
        ctypes.byref(mask),
        ctypes.c_ulong(len(mask) * 64 + 1),
        MPOL_MF_STRICT | MPOL_MF_MOVE,
    )
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mbind to NUMA node {node}: {os.strerror(err)}")


def address_of(buffer, offset: int = 0) -> int:
    """Address of byte ``offset`` inside a writable buffer (an mmap)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer, offset))


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it is gone.

    A pid plus its start time names a process uniquely: pids are reused, start times not.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm may contain spaces and parentheses: split after the last ')'.
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[19])


def alive(pid: int, start_time: int) -> bool:
    return pid > 0 and process_start_time(pid) == start_time
