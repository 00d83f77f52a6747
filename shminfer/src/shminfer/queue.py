"""The shared-memory queue: one segment per worker CPU, fixed slots, a state machine.

Segment layout (all little-endian)::

    page 0      header (magic, geometry, pids, doorbell futex, model description)
    states      slot_count x u32, contiguous: each a futex word; a slot is READY when its
                u32 word equals READY (the C scans and the Python ones alike, see ready_slots)
    slot table  slot_count x 128-byte slot headers
    requests    slot_count x request_bytes  (64-byte aligned)
    responses   slot_count x response_bytes
    metrics     ring of per-batch records written by the worker

Slot states: FREE -> WRITING -> READY -> PROCESSING -> DONE | ERROR -> FREE.

Every transition has exactly one writer, so no compare-and-swap is needed: the client that
leases a slot moves it FREE->WRITING->READY and DONE/ERROR->FREE; the worker moves it
READY->PROCESSING->DONE/ERROR; the supervisor only touches slots whose worker is dead or
whose client is gone, and never one the worker holds: the worker's record of its claims
is private memory shared with the supervisor, not a word here a peer could rewrite.
Slots are leased to a client connection by the supervisor once, at attach time, not per
request. The store order this relies on (payload before state, claim before PROCESSING)
is what x86-64 guarantees; the futex calls on the slow path are full barriers.

The segment is a memfd sealed with F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL, fully allocated
with posix_fallocate: no client can truncate it under the supervisor or the worker (the
SIGBUS a truncated /dev/shm file caused), and a segment that does not fit in memory is a
clear error at start. The supervisor hands the fd to the worker at spawn and to clients
over its unix socket (SCM_RIGHTS), with the geometry: nobody trusts the header's copy.
Slots are leased by the supervisor, per client connection (see server.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import stat
import struct
import time

import numpy as np

from shminfer import _sys

MAGIC = b"SHMINF01"
PAGE = 4096
SLOT_HEADER = 128

FREE, WRITING, READY, PROCESSING, DONE, ERROR = range(6)
STATE_NAMES = ("FREE", "WRITING", "READY", "PROCESSING", "DONE", "ERROR")

WORKER_STARTING, WORKER_READY, WORKER_DEAD, WORKER_STOPPED = range(4)

# header fields: name -> (offset, struct format)
_H = {
    "magic": (0, "8s"),
    "slot_count": (8, "<I"),
    "request_bytes": (16, "<Q"),
    "response_bytes": (24, "<Q"),
    "supervisor_pid": (32, "<I"),
    "worker_pid": (36, "<I"),
    "worker_generation": (40, "<I"),
    "worker_state": (44, "<I"),
    "doorbell": (48, "<I"),  # futex word the worker sleeps on
    "worker_sleeping": (52, "<I"),
    "numa_node": (56, "<i"),
    "cpu": (60, "<i"),
    "ring_records": (64, "<Q"),
    "ring_head": (72, "<Q"),  # records written so far (single writer: the worker)
    "created_ns": (80, "<Q"),
    "model_len": (88, "<I"),
}
MODEL_OFFSET = 1024  # JSON description of the model's inputs/outputs, up to PAGE

# slot header fields (the state word lives in the contiguous states array)
_S = {
    "waiter": (4, "<I"),
    "seq": (8, "<Q"),
    "owner_pid": (16, "<I"),
    "request_len": (20, "<I"),
    "owner_start": (24, "<Q"),
    "response_len": (32, "<I"),
    "batch_size": (36, "<I"),
    "enqueue_ns": (40, "<Q"),
    "start_ns": (48, "<Q"),
    "done_ns": (56, "<Q"),
    "generation": (64, "<I"),  # lease generation: bumped each time the slot is leased
    "response_seq": (72, "<Q"),  # the seq of the request this response answers
}

_READY_WORD = struct.pack("<I", READY)

# The hot path reads and writes header and slot fields as items of memoryview casts (u32
# and u64, native order: little-endian on every supported machine) instead of struct
# calls: item = byte offset / item size. Slot headers are 128 bytes: 32 u32 or 16 u64 items.
H32_DOORBELL = _H["doorbell"][0] // 4
H32_WORKER_SLEEPING = _H["worker_sleeping"][0] // 4
H32_WORKER_STATE = _H["worker_state"][0] // 4
H64_RING_HEAD = _H["ring_head"][0] // 8
S32 = SLOT_HEADER // 4  # u32 items per slot header
S64 = SLOT_HEADER // 8
S32_WAITER = _S["waiter"][0] // 4
S32_REQUEST_LEN = _S["request_len"][0] // 4
S32_RESPONSE_LEN = _S["response_len"][0] // 4
S32_BATCH_SIZE = _S["batch_size"][0] // 4
S64_SEQ = _S["seq"][0] // 8
S64_ENQUEUE_NS = _S["enqueue_ns"][0] // 8
S64_START_NS = _S["start_ns"][0] // 8
S64_DONE_NS = _S["done_ns"][0] // 8
S64_RESPONSE_SEQ = _S["response_seq"][0] // 8

# Per-batch CPU time in the ring (worker.py): exact for every batch whose wall time is at
# least CPU_EXACT_NS; a shorter batch may record CPU_NOT_MEASURED instead (metrics.py).
# 0.1 ms is 10x below the smallest deschedule gate (the post-check's 1 ms p99.9).
CPU_EXACT_NS = 100_000
CPU_NOT_MEASURED = (1 << 64) - 1
RING_FIELDS = ("done_ns", "wall_ns", "process_cpu_ns", "thread_cpu_ns", "queue_wait_ns", "batch")
_RING = struct.Struct("<6Q")
# A request's queue wait comes from its enqueue stamp, a client's clock: a stamp after the
# batch's start, or more than this before it (a client in another time namespace), is no
# wait this worker saw and is recorded as 0 (the C loop, _fast.c, does the same).
QUEUE_WAIT_MAX_NS = 60 * 10**9


def queue_wait_ns(start_ns: int, enqueued_ns: int) -> int:
    """The queue wait of a request enqueued at ``enqueued_ns`` whose batch started at
    ``start_ns``; 0 when the stamp is not a plausible one (QUEUE_WAIT_MAX_NS)."""
    wait = start_ns - enqueued_ns
    return wait if 0 <= wait <= QUEUE_WAIT_MAX_NS else 0


MAX_SLOTS = 4096
# memfd sealing (linux/fcntl.h); fcntl has the names from Python 3.9 on some builds only.
MFD_ALLOW_SEALING = getattr(os, "MFD_ALLOW_SEALING", 2)
F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
F_SEAL_SEAL = getattr(fcntl, "F_SEAL_SEAL", 1)
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 2)
F_SEAL_GROW = getattr(fcntl, "F_SEAL_GROW", 4)
MAX_SLOT_BYTES = 1 << 30


class QueueError(RuntimeError):
    pass


def _mem_available():
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _round_page(n):
    return (n + PAGE - 1) // PAGE * PAGE


def _geometry(slot_count, request_bytes, response_bytes, ring_records):
    states = PAGE
    table = states + _round_page(slot_count * 4)
    requests = table + slot_count * SLOT_HEADER
    requests = (requests + PAGE - 1) // PAGE * PAGE
    responses = requests + slot_count * request_bytes
    ring = responses + slot_count * response_bytes
    total = ring + ring_records * _RING.size
    return states, table, requests, responses, ring, _round_page(total)


RING_RECORDS = 8192


def slot_bytes(value: int) -> int:
    """A slot's request or response size as a segment lays it out (64-byte multiples)."""
    return (int(value) + 63) // 64 * 64


def segment_bytes(slot_count, request_bytes, response_bytes, ring_records=RING_RECORDS) -> int:
    """The bytes of one worker's segment (each is fully allocated at start)."""
    return _geometry(
        slot_count, slot_bytes(request_bytes), slot_bytes(response_bytes), ring_records
    )[-1]


class Segment:
    """One mapped queue segment (creator or attacher)."""

    def __init__(self, path, fd, mm, owner, geometry):
        """``geometry`` (slot_count, request_bytes, response_bytes, ring_records) comes from
        the supervisor, never from the header a peer may have scribbled on."""
        self.path = path
        self.fd = fd
        self.mm = mm
        self.owner = owner
        self.buf = memoryview(mm)
        self.slot_count, self.request_bytes, self.response_bytes, self.ring_records = (
            int(v) for v in geometry
        )
        (
            self.states_off,
            self.table_off,
            self.requests_off,
            self.responses_off,
            self.ring_off,
            self.size,
        ) = _geometry(self.slot_count, self.request_bytes, self.response_bytes, self.ring_records)
        if self.size > len(mm):
            raise QueueError(f"{path}: {len(mm)} bytes mapped, the geometry needs {self.size}")
        # Slot states: a numpy view for vector work, a memoryview of u32 for the hot path
        # (one state read or write there is ~50 ns instead of ~300 ns through numpy).
        self.states = np.ndarray(
            (self.slot_count,), dtype=np.uint32, buffer=mm, offset=self.states_off
        )
        self.state_words = self.buf[self.states_off : self.states_off + 4 * self.slot_count].cast(
            "I"
        )
        self._states_end = self.states_off + 4 * self.slot_count
        table = self.buf[self.table_off : self.table_off + SLOT_HEADER * self.slot_count]
        self.slot32 = table.cast("I")  # slot i's field f: slot32[i * S32 + S32_f]
        self.slot64 = table.cast("Q")
        table.release()
        self.head32 = self.buf[:PAGE].cast("I")
        self.head64 = self.buf[:PAGE].cast("Q")
        self.owners = np.ndarray(
            (self.slot_count,),
            dtype=np.uint32,
            buffer=mm,
            offset=self.table_off + 16,
            strides=(SLOT_HEADER,),
        )
        self.waiters = np.ndarray(
            (self.slot_count,),
            dtype=np.uint32,
            buffer=mm,
            offset=self.table_off + 4,
            strides=(SLOT_HEADER,),
        )
        self.doorbell_addr = _sys.address_of(mm, _H["doorbell"][0])
        self._state_addr0 = _sys.address_of(mm, self.states_off)
        self.header_addr = _sys.address_of(mm, 0)
        self._slot_addr0 = _sys.address_of(mm, self.table_off)

    # ------------------------------------------------------------ lifecycle

    @classmethod
    def create(
        cls,
        name,
        *,
        slot_count=64,
        request_bytes=65536,
        response_bytes=65536,
        ring_records=RING_RECORDS,
        numa_node=-1,
        cpu=-1,
        mode=0o600,
        gid=None,
    ):
        """A new segment: a sealed memfd (no file in /dev/shm anyone could truncate).

        ``mode``/``gid`` are kept for callers; access goes through the server's socket.
        """
        del mode, gid
        if not 1 <= slot_count <= MAX_SLOTS:
            raise QueueError(f"--slots must be 1..{MAX_SLOTS}, got {slot_count}")
        for flag, value in (
            ("--request-bytes", request_bytes),
            ("--response-bytes", response_bytes),
        ):
            if not 64 <= int(value) <= MAX_SLOT_BYTES:
                raise QueueError(f"{flag} must be 64..{MAX_SLOT_BYTES} (1 GiB), got {value}")
        request_bytes, response_bytes = slot_bytes(request_bytes), slot_bytes(response_bytes)
        geometry = (slot_count, request_bytes, response_bytes, ring_records)
        size = segment_bytes(*geometry)
        available = _mem_available()
        if available is not None and size > available:
            raise QueueError(
                f"segment {name} needs {size} bytes ({slot_count} slots x "
                f"{request_bytes}+{response_bytes} bytes), more than the {available} bytes of "
                "memory available: lower --slots, --request-bytes or --response-bytes"
            )
        fd = os.memfd_create(name, os.MFD_CLOEXEC | MFD_ALLOW_SEALING)
        mm = None
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if numa_node >= 0:
                # Bind before the first page exists: the pages land on the worker's node.
                _sys.mbind(_sys.address_of(mm), size, numa_node)
            try:
                # Every page now, or a clear error: never a SIGBUS on first touch later.
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise QueueError(
                    f"segment {name}: cannot allocate {size} bytes ({exc.strerror}): lower "
                    "--slots, --request-bytes or --response-bytes"
                ) from None
            # Nobody (not even a client holding the fd) can shrink or grow it, nor unseal.
            fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
            header = {
                "magic": MAGIC,
                "slot_count": slot_count,
                "request_bytes": request_bytes,
                "response_bytes": response_bytes,
                "supervisor_pid": os.getpid(),
                "numa_node": numa_node,
                "cpu": cpu,
                "ring_records": ring_records,
                "created_ns": time.time_ns(),
            }
            for key, value in header.items():
                offset, fmt = _H[key]
                struct.pack_into(fmt, mm, offset, value)
            return cls(f"memfd:{name}", fd, mm, owner=True, geometry=geometry)
        except BaseException:
            if mm is not None:
                mm.close()
            os.close(fd)
            raise

    @property
    def geometry(self):
        return (self.slot_count, self.request_bytes, self.response_bytes, self.ring_records)

    @classmethod
    def from_fd(cls, fd, name, geometry):
        """Map a segment handed over by the server (the fd is taken over)."""
        try:
            st = os.fstat(fd)
            size = _geometry(*geometry)[-1]
            seals = fcntl.fcntl(fd, F_GET_SEALS)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                raise QueueError(f"{name}: {st.st_size} bytes, the server said {size}")
            if seals & (F_SEAL_SHRINK | F_SEAL_GROW) != F_SEAL_SHRINK | F_SEAL_GROW:
                raise QueueError(f"{name}: not sealed against resizing: refused")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        # No magic check: the header is every client's to scribble, and the fd's provenance
        # (the server's socket, its peer's uid, a sealed memfd of the announced size) is
        # what is trusted. A peer that overwrote the magic must not lock out new clients
        # nor crash-loop a restarted worker (issue 27).
        try:
            return cls(f"memfd:{name}", fd, mm, owner=False, geometry=geometry)
        except BaseException:
            mm.close()
            os.close(fd)
            raise

    def close(self):
        for view in ("states", "owners", "waiters"):
            setattr(self, view, None)
        for view in (self.state_words, self.slot32, self.slot64, self.head32, self.head64):
            view.release()
        self.buf.release()
        with contextlib.suppress(BufferError):  # a caller still holds a view
            self.mm.close()
        os.close(self.fd)

    def unlink(self):
        """Nothing to remove: a memfd goes when its last fd and mapping are gone."""

    # ------------------------------------------------------------ header / slot fields

    def get(self, key):
        offset, fmt = _H[key]
        return struct.unpack_from(fmt, self.mm, offset)[0]

    def set(self, key, value):
        offset, fmt = _H[key]
        struct.pack_into(fmt, self.mm, offset, value)

    def slot_get(self, index, key):
        offset, fmt = _S[key]
        return struct.unpack_from(fmt, self.mm, self.table_off + index * SLOT_HEADER + offset)[0]

    def slot_set(self, index, key, value):
        offset, fmt = _S[key]
        struct.pack_into(fmt, self.mm, self.table_off + index * SLOT_HEADER + offset, value)

    def state_addr(self, index):
        return self._state_addr0 + 4 * index

    def slot_addr(self, index):
        """Address of slot ``index``'s 128-byte header (for the C path)."""
        return self._slot_addr0 + SLOT_HEADER * index

    def any_ready(self):
        return self._next_ready(self.states_off) != -1

    def _next_ready(self, pos):
        """Offset of the first READY word at or after ``pos``, or -1. READY is a u32 compare,
        as in the C scans (_fast.c): a byte match that is not on a word boundary (the word
        0x02000000 followed by FREE) is no READY slot; a peer's word must not keep the
        worker awake (issue 27) or be claimed as a request."""
        find, start, end = self.mm.find, self.states_off, self._states_end
        pos = find(_READY_WORD, pos, end)
        while pos != -1 and (pos - start) & 3:
            pos = find(_READY_WORD, pos + 1, end)
        return pos

    def ready_slots(self):
        """Indices of READY slots (see :meth:`_next_ready`)."""
        found = []
        pos = self._next_ready(self.states_off)
        while pos != -1:
            found.append((pos - self.states_off) // 4)
            pos = self._next_ready(pos + 4)
        return found

    def request_view(self, index) -> memoryview:
        start = self.requests_off + index * self.request_bytes
        return self.buf[start : start + self.request_bytes]

    def response_view(self, index) -> memoryview:
        start = self.responses_off + index * self.response_bytes
        return self.buf[start : start + self.response_bytes]

    def model_info(self):
        length = min(self.get("model_len"), PAGE - MODEL_OFFSET)
        if not length:
            return None
        try:
            info = json.loads(bytes(self.mm[MODEL_OFFSET : MODEL_OFFSET + length]))
        except ValueError:
            return None
        return info if isinstance(info, dict) else None

    def set_model_info(self, info):
        raw = json.dumps(info).encode()
        if len(raw) > PAGE - MODEL_OFFSET:
            raw = json.dumps({k: info[k] for k in ("backend",) if k in info}).encode()
        self.mm[MODEL_OFFSET : MODEL_OFFSET + len(raw)] = raw
        self.set("model_len", len(raw))

    # ------------------------------------------------------------ waking

    def ring_doorbell(self):
        """Tell the worker a slot is READY; a syscall only when it is asleep."""
        if _sys.FAST is not None:
            _sys.FAST.ring_doorbell(self.header_addr)
            return
        head = self.head32
        head[H32_DOORBELL] = (head[H32_DOORBELL] + 1) & 0xFFFFFFFF
        # READY and the doorbell are stored; the fence keeps the load of worker_sleeping
        # from passing them (the worker fences between its sleeping=1 and its re-check of
        # the states): one of the two sides sees the other, never neither.
        _sys.full_fence()
        if head[H32_WORKER_SLEEPING]:
            _sys.futex_wake(self.doorbell_addr)

    def wake_slot(self, index, fenced=False):
        """Wake a client sleeping on the slot; call after storing DONE/ERROR. ``fenced``:
        the caller fenced after its state stores already (one fence per batch)."""
        if not fenced:
            _sys.full_fence()
        if self.slot32[index * S32 + S32_WAITER]:
            _sys.futex_wake(self.state_addr(index))

    # ------------------------------------------------------------ leases

    # ------------------------------------------------------------ metrics ring

    def ring_append(self, record):
        head = self.head64[H64_RING_HEAD]
        _RING.pack_into(self.mm, self.ring_off + (head % self.ring_records) * _RING.size, *record)
        self.head64[H64_RING_HEAD] = (head + 1) & 0xFFFFFFFFFFFFFFFF  # a peer's scribble too

    def ring_read(self, since=0):
        """Records written after ``since`` (a ring_head value), oldest first, and the head."""
        head = self.get("ring_head")
        start = max(since, head - self.ring_records)
        records = [
            _RING.unpack_from(self.mm, self.ring_off + (i % self.ring_records) * _RING.size)
            for i in range(start, head)
        ]
        return np.array(records, dtype=np.float64).reshape(-1, len(RING_FIELDS)), head


def fail_inflight(segment, message, states=(PROCESSING,)):
    """Turn slots a dead worker had claimed into ERROR responses and wake their clients.

    READY slots stay: the restarted worker serves them.
    """
    raw = message.encode()[: segment.response_bytes]
    failed = 0
    for found in np.flatnonzero(np.isin(segment.states, states)):
        index = int(found)
        response = segment.response_view(index)
        response[: len(raw)] = raw
        segment.slot_set(index, "response_len", len(raw))
        segment.slot_set(index, "response_seq", segment.slot_get(index, "seq"))
        segment.states[index] = ERROR
        _sys.futex_wake(segment.state_addr(index))
        failed += 1
    return failed
