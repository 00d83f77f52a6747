"""Thin Linux system-call wrappers: futex, mbind, process identity.

ctypes over libc's syscall(2), so the runtime needs no compiler on the node. Numbers are
per-architecture; x86_64 and aarch64 are supported.

When the optional C extension ``shminfer._fast`` is built (setup.py; stable ABI) and
SHMINFER_PURE is not ``1``, the fence and futex calls are its functions and ``FAST`` is
the module (the client and worker use its publish/spin/answer too); otherwise ``FAST``
is None and everything runs in pure Python. ``IMPLEMENTATION`` says which: "c" or "pure".
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


# A full memory fence (store -> load ordering) from pure Python.
#
# The doorbell and the slot waits are Dekker-style handshakes: each side stores its flag
# (READY + doorbell, or waiter = 1) and then loads the other's (sleeping, or the state).
# x86-64 is TSO: it never reorders stores with stores or loads with loads, but a store may
# sit in the store buffer while a later load executes, so both sides can read the other's
# old value and the wake-up is lost (until the 50 ms safety wait). A LOCK-prefixed
# instruction drains the store buffer before any later load: pthread_spin_lock is a
# `lock decl` / `lock cmpxchg` in glibc and musl, so taking and dropping a private spinlock
# through ctypes is a full fence at the cost of a foreign call (~0.2 us), no syscall.
# Elsewhere (aarch64, whose spinlock acquire is not a store->load barrier) the fence is a
# futex wake on a private word: the kernel's futex path issues smp_mb().
_fence_lock = ctypes.c_int(1)  # glibc/musl x86: 1 = unlocked
_fence_word = ctypes.c_uint32(0)
if _MACHINE == "x86_64" and hasattr(_libc, "pthread_spin_trylock"):
    # One foreign call: trylock is a `lock cmpxchg` (taking the free lock), then the lock
    # is made free again by a plain store from Python (we are its only user).
    _spin_trylock = _libc.pthread_spin_trylock
    _spin_trylock.argtypes = (ctypes.c_void_p,)
    _fence_addr = ctypes.addressof(_fence_lock)

    def full_fence() -> None:
        _spin_trylock(_fence_addr)
        _fence_lock.value = 1

else:

    def full_fence() -> None:
        _syscall(_require("futex"), ctypes.byref(_fence_word), FUTEX_WAKE | 128, 1, None, None, 0)


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


try:
    from shminfer import _fast as _FAST_MODULE
except ImportError:  # not built (no compiler, no Python headers, not Linux): pure only
    _FAST_MODULE = None
_PURE = (full_fence, futex_wait, futex_wake)


def use(implementation: str) -> str:
    """Switch this process's hot path: "c" (when built) or "pure"; returns the one in use.

    Import time chooses from SHMINFER_PURE; ``shminfer bench ipc`` switches to measure
    both paths in one run (worker processes follow SHMINFER_PURE in their environment).
    """
    global FAST, IMPLEMENTATION, full_fence, futex_wait, futex_wake  # noqa: PLW0603
    FAST = _FAST_MODULE if implementation == "c" else None
    IMPLEMENTATION = "pure" if FAST is None else "c"
    if FAST is None:
        full_fence, futex_wait, futex_wake = _PURE
    else:
        full_fence, futex_wait, futex_wake = FAST.fence, FAST.futex_wait, FAST.futex_wake
    return IMPLEMENTATION


FAST = None
IMPLEMENTATION = "pure"
use("pure" if os.environ.get("SHMINFER_PURE", "").strip() in ("1", "true", "yes") else "c")
