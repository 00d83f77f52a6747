"""The shared-memory queue: one segment per worker CPU, fixed slots, a state machine.

Segment layout (all little-endian)::

    page 0      header (magic, geometry, pids, doorbell futex, model description)
    states      slot_count x u32, contiguous: each a futex word; a scan is one bytes.find
    slot table  slot_count x 128-byte slot headers
    requests    slot_count x request_bytes  (64-byte aligned)
    responses   slot_count x response_bytes
    metrics     ring of per-batch records written by the worker

Slot states: FREE -> WRITING -> READY -> PROCESSING -> DONE | ERROR -> FREE.

Every transition has exactly one writer, so no compare-and-swap is needed: the client that
leases a slot moves it FREE->WRITING->READY and DONE/ERROR->FREE; the worker moves it
READY->PROCESSING->DONE/ERROR; the supervisor only touches slots whose worker is dead or
whose client is dead. Slots are leased to a client process under flock(2) once, at
attach time, not per request. The store order this relies on (payload before state) is
what x86-64 guarantees; the futex calls on the slow path are full barriers.

The segment is a plain file in /dev/shm opened with O_EXCL and mode 0600/0660: its life
is owned by the supervisor (created at start, unlinked at stop, stale ones removed at the
next start) and never by multiprocessing's resource tracker.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import struct
import time

import numpy as np

from shminfer import _sys

MAGIC = b"SHMINF01"
SHM_DIR = "/dev/shm"
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

RING_FIELDS = ("done_ns", "wall_ns", "process_cpu_ns", "thread_cpu_ns", "queue_wait_ns", "batch")
_RING = struct.Struct("<6Q")


MAX_SLOTS = 4096
MAX_SLOT_BYTES = 1 << 30
_GEOMETRY_FIELDS = ("slot_count", "request_bytes", "response_bytes", "ring_records")


class QueueError(RuntimeError):
    pass


def segment_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


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


def _checked_geometry(mm, size, path):
    """The header's geometry, refused unless it is sane and matches the mapping's size."""
    fields = [struct.unpack_from(_H[k][1], mm, _H[k][0])[0] for k in _GEOMETRY_FIELDS]
    slot_count, request_bytes, response_bytes, ring_records = fields
    sane = (
        1 <= slot_count <= MAX_SLOTS
        and 64 <= request_bytes <= MAX_SLOT_BYTES
        and 64 <= response_bytes <= MAX_SLOT_BYTES
        and request_bytes % 64 == 0
        and response_bytes % 64 == 0
        and 1 <= ring_records <= 1 << 24
    )
    if not sane or _geometry(*fields)[-1] != size:
        raise QueueError(f"{path}: the header's geometry is corrupt (a peer wrote over it?)")
    return fields


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

    # ------------------------------------------------------------ lifecycle

    @classmethod
    def create(
        cls,
        name,
        *,
        slot_count=64,
        request_bytes=65536,
        response_bytes=65536,
        ring_records=8192,
        numa_node=-1,
        cpu=-1,
        mode=0o600,
        gid=None,
    ):
        if not 1 <= slot_count <= MAX_SLOTS:
            raise QueueError(f"--slots must be 1..{MAX_SLOTS}, got {slot_count}")
        for flag, value in (
            ("--request-bytes", request_bytes),
            ("--response-bytes", response_bytes),
        ):
            if not 64 <= int(value) <= MAX_SLOT_BYTES:
                raise QueueError(f"{flag} must be 64..{MAX_SLOT_BYTES} (1 GiB), got {value}")
        request_bytes = (int(request_bytes) + 63) // 64 * 64
        response_bytes = (int(response_bytes) + 63) // 64 * 64
        geometry = _geometry(slot_count, request_bytes, response_bytes, ring_records)
        path = segment_path(name)
        old_umask = os.umask(0o077 if mode == 0o600 else 0o007)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        except FileExistsError:
            raise QueueError(f"{path} exists: another server owns it, or a stale one") from None
        finally:
            os.umask(old_umask)
        try:
            if gid is not None:
                os.fchown(fd, -1, gid)
            os.fchmod(fd, mode)
            os.ftruncate(fd, geometry[-1])
            mm = mmap.mmap(fd, geometry[-1], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if numa_node >= 0:
                # Bind before the first touch, then touch every page from here: the pages
                # land on the worker's node whoever touches them later.
                _sys.mbind(_sys.address_of(mm), geometry[-1], numa_node)
            for offset in range(0, geometry[-1], PAGE):
                mm[offset] = 0
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
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        return cls(
            path,
            fd,
            mm,
            owner=True,
            geometry=(slot_count, request_bytes, response_bytes, ring_records),
        )

    @property
    def geometry(self):
        return (self.slot_count, self.request_bytes, self.response_bytes, self.ring_records)

    @classmethod
    def attach(cls, name, geometry=None):
        path = segment_path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise QueueError(f"{path} does not exist: is `shminfer serve` running?") from None
        except PermissionError:
            raise QueueError(
                f"{path}: permission denied (the server created it 0600/0660 for its user/group)"
            ) from None
        size = os.fstat(fd).st_size
        if size < PAGE:
            os.close(fd)
            raise QueueError(f"{path} is not a shminfer segment (too small)")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        if mm[:8] != MAGIC:
            mm.close()
            os.close(fd)
            raise QueueError(f"{path} is not a shminfer segment (bad magic)")
        try:
            if geometry is None:
                geometry = _checked_geometry(mm, size, path)
            return cls(path, fd, mm, owner=False, geometry=geometry)
        except BaseException:
            mm.close()
            os.close(fd)
            raise

    def close(self):
        for view in ("states", "owners", "waiters"):
            setattr(self, view, None)
        self.state_words.release()
        self.buf.release()
        with contextlib.suppress(BufferError):  # a caller still holds a view
            self.mm.close()
        os.close(self.fd)

    def unlink(self):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

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

    def any_ready(self):
        return self.mm.find(_READY_WORD, self.states_off, self._states_end) != -1

    def ready_slots(self):
        """Indices of READY slots. A u32 state's low byte is its only non-zero byte, so a
        byte match of the little-endian word can only start on a word boundary."""
        found = []
        pos = self.mm.find(_READY_WORD, self.states_off, self._states_end)
        while pos != -1:
            found.append((pos - self.states_off) // 4)
            pos = self.mm.find(_READY_WORD, pos + 4, self._states_end)
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
        offset = _H["doorbell"][0]
        value = (struct.unpack_from("<I", self.mm, offset)[0] + 1) & 0xFFFFFFFF
        struct.pack_into("<I", self.mm, offset, value)
        if struct.unpack_from("<I", self.mm, _H["worker_sleeping"][0])[0]:
            _sys.futex_wake(self.doorbell_addr)

    def wake_slot(self, index):
        if self.waiters[index]:
            _sys.futex_wake(self.state_addr(index))

    # ------------------------------------------------------------ leases

    def _leasable(self, index):
        """Nobody holds the slot and no request of a former holder is in flight.

        A slot whose client left (closed, timed out, died) while its request is READY or
        PROCESSING belongs to the worker until answered: leasing it then would hand the
        departed client's answer to the next one.
        """
        if int(self.states[index]) in (READY, PROCESSING):
            return False
        owner = int(self.owners[index])
        return not owner or not _sys.alive(owner, self.slot_get(index, "owner_start"))

    def lease_slots(self, count, pid, start_time):
        """Lease up to ``count`` free slots to a client process (under flock).

        Returns ``[(index, generation)]``; the generation goes into every request tag.
        """
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            leased = []
            for index in range(self.slot_count):
                if len(leased) == count:
                    break
                if not self._leasable(index):
                    continue
                generation = (self.slot_get(index, "generation") + 1) & 0xFFFFFFFF
                self.slot_set(index, "generation", generation)
                self.slot_set(index, "owner_start", start_time)
                self.slot_set(index, "owner_pid", pid)
                self.states[index] = FREE
                leased.append((index, generation))
            return leased
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def reclaim_orphaned(self):
        """Free the slots of departed clients whose last request has ended (under flock)."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            for index in range(self.slot_count):
                idle = int(self.states[index]) == FREE and not int(self.owners[index])
                if not idle and self._leasable(index):
                    self.states[index] = FREE
                    self.slot_set(index, "owner_pid", 0)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def release_slots(self, indices, pid):
        """Give slots back; one with a request in flight stays busy until answered."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            for index in indices:
                if int(self.owners[index]) == pid:
                    if int(self.states[index]) not in (READY, PROCESSING):
                        self.states[index] = FREE
                    self.slot_set(index, "owner_pid", 0)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    # ------------------------------------------------------------ metrics ring

    def ring_append(self, record):
        head = self.get("ring_head")
        _RING.pack_into(self.mm, self.ring_off + (head % self.ring_records) * _RING.size, *record)
        self.set("ring_head", head + 1)

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
