"""shminfer against unlucky and hostile peers (issue 12): on real processes and real shared
memory, each test fails (or would hang, bounded by its timeouts) without the fix it covers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from shminfer_serving import CPUS, attach, wait_for
from shminfer_serving import serving as _serving

from shminfer.client import Client, InferenceError, Pending, ServerStopped
from shminfer.codec import Decoder, Encoder, PayloadError
from shminfer.queue import DONE, ERROR, PROCESSING, QueueError
from shminfer.registry import (
    LOCK,
    REGISTRY,
    SOCKET,
    make_unit_dir,
    read_registry,
    registry_path,
    socket_path,
    unit_dir,
)
from shminfer.server import Server


def serving(*args, slots=8, **kwargs):
    """Hostile tests remove and replace the server's files themselves: no cleanup check."""
    return _serving(
        *args, slots=slots, prefix="h", reclaim_every_s=0.05, check_cleanup=False, **kwargs
    )


def _x(value, rows=1, width=64):
    return {"x": np.full((rows, width), value, dtype=np.float32)}


def _lease(name, timeout=20.0, **kwargs):
    """A client, retrying while every slot is still in flight for someone else."""
    retry = ("no free slot", "no shminfer server", "not running", "is missing")
    return attach(name, timeout, retry, pause=0.01, **kwargs)


def _python(code, *args, timeout=60):
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


# ---------------------------------------------------------------- 1: another client's answer

_SUBMIT_AND_LEAVE = """
import sys, time, numpy as np
from shminfer.client import Client
from shminfer.queue import PROCESSING
name, value, how = sys.argv[1], float(sys.argv[2]), sys.argv[3]
# Attach with time to spare (a loaded machine answered the handshake in > 50 ms), then
# wait only 50 ms for the answer, so the "timeout" client gives up mid-batch.
c = Client(name, slots_per_worker=1, timeout=30)
c.timeout = 0.05
p = c.start({"x": np.full((1, 64), value, np.float32)})
lane = c.lanes[0]
deadline = time.monotonic() + 20
while lane.seg.state_words[p.slot] != PROCESSING and time.monotonic() < deadline:
    time.sleep(0.001)
if how == "timeout":
    try:
        c.finish(p)
    except TimeoutError:
        pass
c.close()
print("left", flush=True)
"""


@pytest.mark.parametrize("how", ["close", "timeout"])
def test_a_client_never_gets_the_answer_of_a_client_that_left(how):
    """A submits and leaves (closes, or times out and exits) while the worker computes; B
    leases the same slot. B must get its own answer, never A's."""
    with serving(backend="sleep", model="300", slots=1) as server:
        with Client(server.name) as warm:
            warm.wait_ready(60)
        wrong = 0
        for round_ in range(3):
            a_value, b_value = 1000.0 + round_, 2000.0 + round_
            left = _python(_SUBMIT_AND_LEAVE, server.name, a_value, how)
            assert "left" in left.stdout, left.stderr
            with _lease(server.name, slots_per_worker=1, timeout=10) as b:
                out = b.infer(_x(b_value), timeout=20)["y"]
            assert np.all(out == out.flat[0])
            wrong += int(out.flat[0] != b_value)
        assert wrong == 0, f"{wrong} of 3 answers B received were A's"


def test_every_response_carries_the_request_tag_the_client_checks():
    """A response published under another request's tag (a peer rewound the slot) is refused."""
    with (
        serving(backend="sleep", model="200", slots=2) as server,
        Client(server.name, slots_per_worker=1) as client,
    ):
        client.wait_ready(60)
        pending = client.start(_x(5.0))
        lane = client.lanes[0]
        wait_for(lambda: lane.seg.state_words[pending.slot] == PROCESSING, 10, "the worker's claim")
        # A peer forges the request tag while the worker computes: the worker answers
        # with the tag it claimed, which is no longer the one the client expects.
        lane.seg.slot_set(pending.slot, "seq", pending.seq + 7)
        pending.seq += 7
        with pytest.raises(InferenceError, match="another request"):
            client.finish(pending, timeout=20)
        assert np.all(client.infer(_x(6.0), timeout=20)["y"] == 6.0)


_SCRIBBLE_OWN_AND_LEAVE = """
import sys, time, numpy as np
from shminfer.client import Client
from shminfer.queue import PROCESSING
name, value, word = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
c = Client(name, slots_per_worker=1, timeout=5)
p = c.start({"x": np.full((1, 64), value, np.float32)})
seg = c.lanes[0].seg
deadline = time.monotonic() + 20
while seg.state_words[p.slot] != PROCESSING and time.monotonic() < deadline:
    time.sleep(0.001)
# The worker holds the slot: rewrite its state word as if the request had ended, leave.
seg.state_words[p.slot] = word
c.close()
print("left", p.slot, flush=True)
"""


@pytest.mark.parametrize("word", [0, DONE, ERROR, 0x4D], ids=["FREE", "DONE", "ERROR", "garbage"])
def test_a_peer_that_rewrites_its_claimed_slot_and_leaves_cannot_hand_it_on(word):
    """A peer submits, waits for the worker's claim, rewrites its own slot's state word to
    something that is not in flight and leaves. The supervisor must not lease that slot
    again while the worker may still answer into it: the next, well-behaved client gets
    its own answer (the soak's refusal under the previous lease's tag)."""
    with serving(backend="sleep", model="3000", slots=1) as server:
        with Client(server.name) as warm:
            warm.wait_ready(60)
        cpu = server.cpus[0]
        left = _python(_SCRIBBLE_OWN_AND_LEAVE, server.name, 7.0, word)
        assert "left" in left.stdout, left.stderr
        wait_for(lambda: server._holder[cpu][0] is None, 10, "the peer's lease to end")
        # The worker is still computing the peer's request (3 s): an answer to come.
        assert server.status[cpu][0], "the worker answered before the peer's lease ended"
        with _lease(server.name, slots_per_worker=1, timeout=20) as client:
            out = client.infer(_x(8.0), timeout=20)["y"]
            assert np.all(out == 8.0)
            # The slot is reusable at once: nothing is left to land in it.
            assert np.all(client.infer(_x(9.0), timeout=20)["y"] == 9.0)


# ---------------------------------------------------------------- 2: validation


def _descriptor(name=b"x", dtype=b"<f4", dims=(1, 4), offset=64, nbytes=None, *, count=1):
    """A hand-made payload descriptor, as a hostile peer would write it."""
    if nbytes is None:
        nbytes = 4 * int(np.prod([d % 1000 for d in dims]))
    body = struct.pack("<H", count) + bytes([len(name)]) + name + bytes([len(dtype)]) + dtype
    body += bytes([len(dims)]) + b"".join(struct.pack("<Q", d) for d in dims)
    body += struct.pack("<QQ", offset, nbytes)
    return struct.pack("<I", len(body)) + body


CRAFTED = {
    "2^32 x 2^32, 0 bytes": _descriptor(dims=(2**32, 2**32), nbytes=0, offset=1024),
    "65 dims": _descriptor(dims=(1,) * 65, nbytes=4, offset=1024),
    "(2^62+1, 4)": _descriptor(dims=(2**62 + 1, 4), nbytes=16, offset=1024),
    "object dtype": _descriptor(dtype=b"|O8", nbytes=32, offset=1024),
    "void dtype": _descriptor(dtype=b"|V4096", nbytes=4096, offset=1024),
    "structured dtype": _descriptor(dtype=b"[('a','<i4')]", offset=1024),
    "bad utf-8 name": _descriptor(name=b"\xff\xfe", offset=1024),
    "65535 arrays": struct.pack("<IH", 2, 65535),
    "misaligned": _descriptor(offset=1025),
    "overlaps the header": _descriptor(offset=0),
}


@pytest.mark.parametrize("payload", list(CRAFTED.values()), ids=list(CRAFTED))
def test_the_decoder_refuses_crafted_descriptors(payload):
    buf = memoryview(bytearray(8192))
    buf[: len(payload)] = payload
    with pytest.raises(PayloadError):
        Decoder().decode(buf, 8192)


def test_a_descriptor_seen_before_is_refused_in_a_shorter_payload():
    buf = memoryview(bytearray(8192))
    length = Encoder().encode_into(buf, {"x": np.zeros((1, 64), np.float32)})
    for slot in (None, 0):
        decoder = Decoder()
        assert decoder.decode(buf, length, slot=slot)["x"].shape == (1, 64)
        with pytest.raises(PayloadError, match="inside a 319-byte payload"):
            decoder.decode(buf, length - 1, slot=slot)
        assert decoder.decode(buf, length, slot=slot)["x"].shape == (1, 64)


def _scribble_request(client, payload, length=None):
    """Write ``payload`` into one of this client's slots and submit it by hand."""
    lane = client.lanes[0]
    slot = lane.free.pop()
    lane.requests[slot][: len(payload)] = payload
    seg = lane.seg
    seg.slot_set(slot, "request_len", len(payload) if length is None else length)
    seq = (lane.generation[slot] << 32) | 0xFFFF0000
    seg.slot_set(slot, "seq", seq)
    seg.slot_set(slot, "enqueue_ns", time.monotonic_ns())
    seg.state_words[slot] = 2  # READY
    seg.ring_doorbell()
    return Pending(0, slot, seq, time.monotonic() + 20)


def test_crafted_requests_fail_alone_and_the_worker_keeps_serving_others():
    with (
        serving(backend="sleep", model="100", slots=32) as server,
        Client(server.name, slots_per_worker=16) as hostile,
        Client(server.name, slots_per_worker=2) as honest,
    ):
        honest.wait_ready(60)
        worker_pid = honest.lanes[0].seg.get("worker_pid")
        mine = honest.start(_x(42.0))
        crafted = [_scribble_request(hostile, p) for p in CRAFTED.values()]
        crafted.append(_scribble_request(hostile, CRAFTED["65 dims"], length=2**32 - 1))
        for pending in crafted:
            with pytest.raises(InferenceError, match="bad request"):
                hostile.finish(pending, timeout=20)
        assert np.all(honest.finish(mine, timeout=20)["y"] == 42.0)
        assert np.all(honest.infer(_x(43.0), timeout=20)["y"] == 43.0)
        assert honest.lanes[0].seg.get("worker_pid") == worker_pid, "the worker died"
        assert server.restarts[server.cpus[0]] == 0


@contextlib.contextmanager
def _learned_slot():
    """A server of two slots and a client leasing one, five requests answered on it: the
    worker and the client have both learned that slot's layouts. (server, client, lane,
    slot)."""
    with serving(slots=2) as server, Client(server.name, slots_per_worker=1) as client:
        client.wait_ready(60)
        lane = client.lanes[0]
        (slot,) = lane.leased
        for value in range(5):
            assert np.all(client.infer(_x(float(value)), timeout=20)["y"] == value)
        yield server, client, lane, slot


def test_a_request_rewritten_after_its_layout_was_learned_is_checked_again():
    # The worker reuses a slot's decoded views (in C where it is built) only while the
    # request's length word and descriptor bytes are the ones it validated: every rewrite
    # of either is decoded afresh and refused, and the worker keeps serving.
    with _learned_slot() as (server, client, lane, slot):
        seg = lane.seg
        good = bytes(lane.requests[slot][:320])  # 64 bytes of descriptor, 1 x 64 float32
        assert Decoder().decode(memoryview(bytearray(good)), 320)["x"].shape == (1, 64)

        def submit(payload, length):
            lane.free.remove(slot)
            lane.requests[slot][: len(payload)] = payload
            seq = (lane.generation[slot] << 32) | 0xFFFF0000
            seg.slot_set(slot, "request_len", length)
            seg.slot_set(slot, "seq", seq)
            seg.slot_set(slot, "enqueue_ns", time.monotonic_ns())
            seg.state_words[slot] = 2  # READY
            seg.ring_doorbell()
            return client.finish(Pending(0, slot, seq, time.monotonic() + 20), copy=True)

        def rewritten(offset, raw):
            return good[:offset] + raw + good[offset + len(raw) :]

        header_len = struct.unpack_from("<I", good)[0]
        dims_at = 4 + 2 + 2 + 4 + 1  # u32 length, count, "x", "<f4", ndim
        refused = {
            "too short": (good, 319),
            "past the slot": (good, 2**32 - 1),
            "a dimension": (rewritten(dims_at + 8, struct.pack("<Q", 65)), 320),
            "the descriptor length": (rewritten(0, struct.pack("<I", header_len + 1)), 320),
            "the offset": (rewritten(4 + header_len - 16, struct.pack("<Q", 65)), 320),
            "the dtype": (rewritten(dims_at - 4, b"|O8"), 320),
        }
        for what, (payload, length) in refused.items():
            with pytest.raises(InferenceError, match="bad request"):
                submit(payload, length)
                pytest.fail(f"a request with {what} rewritten was answered")
            assert np.all(client.infer(_x(7.0), timeout=20)["y"] == 7.0), what
        # The same descriptor over new data: the data is the request, answered as such.
        fresh = good[:64] + np.full(64, 9.0, np.float32).tobytes()
        assert np.all(submit(fresh, 320)["y"] == 9.0)
        # A scribbled ring head: the worker's next records wrap, inside the ring.
        seg.set("ring_head", 2**64 - 1)
        for value in (10.0, 11.0):
            assert np.all(client.infer(_x(value), timeout=20)["y"] == value)
        assert seg.get("ring_head") == 1
        assert seg.ring_read()[0].shape == (1, 6)
        assert server.restarts[server.cpus[0]] == 0


def test_a_scribbled_worker_state_sends_the_client_down_the_checked_path():
    # Port.start (C) reads one header word, the worker state, and goes on only when it is
    # READY: any other value returns to the Python client, which checks the server itself.
    # The tags it hands out carry the slot's lease generation and the client's counter, as
    # the Python path's do, from the same counter.
    with _learned_slot() as (_, client, lane, slot):
        seg = lane.seg
        port = lane.port
        tags = []
        for word in (0x4D, 0, 2, 3, 0xFFFFFFFF):  # garbage, STARTING, DEAD, STOPPED, garbage
            seg.set("worker_state", word)
            if port is not None:
                assert port.start(_x(1.0), 5.0) is None
                assert lane.free == [slot] and seg.state_words[slot] == 0  # nothing taken
            pending = client.start(_x(float(word & 0xFF)))  # the Python path: answered
            tags.append(pending.seq)
            assert np.all(client.finish(pending)["y"] == float(word & 0xFF))
        seg.set("worker_state", 1)  # READY
        for value in (5.0, 6.0):
            pending = client.start(_x(value))
            assert lane.free == []
            tags.append(pending.seq)
            assert np.all(client.finish(pending)["y"] == value)
            assert lane.free == [slot]
        assert all(tag >> 32 == lane.generation[slot] for tag in tags)
        assert [tag & 0xFFFFFFFF for tag in tags] == sorted({tag & 0xFFFFFFFF for tag in tags})


def test_a_response_rewritten_after_its_layout_was_learned_is_checked_again():
    # The client reuses a slot's decoded response views (in C where it is built: Port.recv)
    # only for DONE under the request's own tag, with the length word and descriptor bytes
    # the decoder validated and a length inside the slot: a forged answer that differs in
    # any of them is read afresh and refused, and the client keeps working.
    with _learned_slot() as (_, client, lane, slot):
        seg = lane.seg
        length = seg.slot_get(slot, "response_len")
        good = bytes(lane.responses[slot][:length])
        counter = iter(range(0xFFFF0000, 0xFFFFFFFF))

        def answered(payload, length, state=DONE, tag=None):
            lane.free.remove(slot)
            seq = (lane.generation[slot] << 32) | next(counter)
            lane.responses[slot][: len(payload)] = payload
            seg.slot_set(slot, "response_len", length)
            seg.slot_set(slot, "response_seq", seq if tag is None else tag)
            seg.state_words[slot] = state
            return client.finish(Pending(0, slot, seq, time.monotonic() + 5, lane), copy=True)

        def rewritten(offset, raw):
            return good[:offset] + raw + good[offset + len(raw) :]

        header_len = struct.unpack_from("<I", good)[0]
        dims_at = 4 + 2 + 2 + 4 + 1  # u32 length, count, "y", "<f4", ndim
        refused = {
            "too short": (good, length - 1, "undecodable"),
            "past the slot": (good, 2**32 - 1, "undecodable"),
            "a dimension": (rewritten(dims_at + 8, struct.pack("<Q", 2**20)), length, "undec"),
            "the descriptor length": (
                rewritten(0, struct.pack("<I", header_len + 1)),
                length,
                "undecodable",
            ),
            "the dtype": (rewritten(dims_at - 4, b"|O8"), length, "undecodable"),
        }
        for what, (payload, size, message) in refused.items():
            with pytest.raises(InferenceError, match=message):
                answered(payload, size)
                pytest.fail(f"a response with {what} rewritten was accepted")
            assert np.all(client.infer(_x(7.0), timeout=20)["y"] == 7.0), what
        with pytest.raises(InferenceError, match="another request"):
            answered(good, length, tag=0x1234)
        with pytest.raises(InferenceError, match="state word"):
            answered(good, length, state=0x4D)
        assert np.all(client.infer(_x(8.0), timeout=20)["y"] == 8.0)
        # The same descriptor over new data: the data is the answer, returned as such.
        data_at = (4 + header_len + 63) // 64 * 64  # the one array's data, 64-byte aligned
        fresh = good[:data_at] + np.full((length - data_at) // 4, 9.0, np.float32).tobytes()
        assert np.all(answered(fresh, length)["y"] == 9.0)
        assert np.all(client.infer(_x(10.0), timeout=20)["y"] == 10.0)


def test_garbage_state_words_and_error_text_are_refused_not_accepted():
    with serving(backend="sleep", model="150", slots=4) as server, Client(server.name) as client:
        client.wait_ready(60)
        lane = client.lanes[0]
        seg = lane.seg
        # A peer sets the state to DONE while the worker computes: the old response in the
        # slot (the previous answer, under its own tag) must not be taken for this one.
        assert np.all(client.infer(_x(1.0), timeout=20)["y"] == 1.0)
        refused = 0
        for value in (2.0, 3.0, 4.0, 5.0):
            pending = client.start(_x(value))
            wait_for(lambda p=pending: seg.state_words[p.slot] == PROCESSING, 10, "claim")
            seg.state_words[pending.slot] = DONE if value % 2 else 0x4D
            with pytest.raises(InferenceError, match=r"another request|state word"):
                client.finish(pending, timeout=20)
            refused += 1
            time.sleep(0.3)  # the worker's late answer lands in the slot
        assert refused == 4
        # Binary garbage as error text is bounded and printable.
        slot = lane.free.pop()
        seq = (lane.generation[slot] << 32) | 0xABCD
        garbage = b"\x1b[2J\x00\xff\xfe" * 10000
        lane.responses[slot][: len(garbage)] = garbage
        seg.slot_set(slot, "response_len", len(garbage))
        seg.slot_set(slot, "response_seq", seq)
        seg.state_words[slot] = ERROR
        with pytest.raises(InferenceError) as caught:
            client.finish(Pending(0, slot, seq, time.monotonic() + 5))
        text = str(caught.value)
        assert len(text) <= 1024 and text.isprintable() and "\x1b" not in text
        # The client keeps working once the worker's late answers are in.
        time.sleep(0.5)
        assert np.all(client.infer(_x(6.0), timeout=20)["y"] == 6.0)


def test_a_scribbled_header_does_not_crash_loop_the_restarted_worker():
    with serving(slots=4) as server, Client(server.name) as client:
        client.wait_ready(60)
        seg = client.lanes[0].seg
        for key, value in (
            ("slot_count", 0xFFFFFFFF),
            ("request_bytes", 2**63),
            ("response_bytes", 3),
            ("ring_records", 0),
            ("model_len", 0xFFFFFFFF),
        ):
            seg.set(key, value)
        old = seg.get("worker_pid")
        os.kill(old, signal.SIGKILL)
        wait_for(
            lambda: seg.get("worker_pid") not in (0, old) and seg.get("worker_state") == 1,
            30,
            "a restarted worker",
        )
        assert np.all(client.infer(_x(7.0), timeout=20)["y"] == 7.0)
        time.sleep(0.5)
        assert server.restarts[server.cpus[0]] == 1, "the worker crash-loops"
        client.model  # noqa: B018 - must not raise on a scribbled model description


# ---------------------------------------------------------------- 3: truncation, memory


def test_no_peer_can_truncate_a_segment_and_the_server_keeps_serving():
    with serving(slots=4) as server, Client(server.name) as client:
        client.wait_ready(60)
        seg = client.lanes[0].seg
        # No segment file anywhere: the server's directory holds only its door.
        assert sorted(os.listdir(unit_dir(server.name))) == sorted([LOCK, REGISTRY, SOCKET])
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, 4096)
        # Re-opened through /proc (a fresh open file description): still sealed.
        worker = seg.get("worker_pid")
        reopened = os.open(f"/proc/self/fd/{seg.fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.ftruncate(reopened, 4096)
        finally:
            os.close(reopened)
        truncate = subprocess.run(
            ["truncate", "-s", "4096", f"/proc/{worker}/fd/{seg.fd}"],
            capture_output=True,
            check=False,
        )
        assert truncate.returncode != 0
        assert np.all(client.infer(_x(8.0), timeout=20)["y"] == 8.0)
        assert seg.get("worker_pid") == worker and server.restarts[server.cpus[0]] == 0


def test_a_segment_larger_than_memory_is_a_clear_error_not_a_sigbus():
    name = f"h{uuid.uuid4().hex[:10]}"
    server = Server(
        name,
        CPUS[-1:],
        numa_node=-1,
        backend="echo",
        slots=4096,
        request_bytes=1 << 30,
        response_bytes=1 << 30,
    )
    # The MemAvailable check refuses it before any memory is touched (posix_fallocate's
    # own failure is the next test's).
    with pytest.raises(QueueError, match=r"more than the \d+ bytes of memory available"):
        server.start()
    assert not os.path.exists(registry_path(name))
    assert not os.path.exists(socket_path(name))


def _mountpoint(fstype, option=None):
    with open("/proc/self/mountinfo", encoding="utf-8") as handle:
        for line in handle:
            fields = line.split()
            tail = fields[fields.index("-") + 1 :]
            if tail[0] == fstype and (option is None or option in tail[2].split(",")):
                return fields[4]
    return None


@contextlib.contextmanager
def _memory_cgroup(limit):
    """(cgroup.procs of a new memory cgroup limited to ``limit`` bytes, whether a process
    must make itself unkillable for an allocation over the limit to fail, not be killed).

    cgroup v1 (as this lab's machines have it): the limit and oom_kill_disable, so an
    allocation over the limit outside a page fault fails with ENOMEM. cgroup v2 has no
    oom_kill_disable: its OOM killer finds no victim in a cgroup whose only process has
    oom_score_adj -1000, and the allocation fails the same way."""
    name = f"shminfer-test-{uuid.uuid4().hex[:8]}"
    v1 = _mountpoint("cgroup", "memory")
    v2 = _mountpoint("cgroup2")
    if v1:
        path = os.path.join(v1, name)
        settings = {"memory.limit_in_bytes": limit, "memory.oom_control": 1}
        unkillable = False
    elif v2 and "memory" in Path(v2, "cgroup.subtree_control").read_text().split():
        path = os.path.join(v2, name)
        settings = {"memory.max": limit, "memory.swap.max": 0}
        unkillable = True
    else:
        pytest.skip("no memory cgroup controller to limit a process with")
    try:
        os.mkdir(path)
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup: {exc}")
    try:
        for key, value in settings.items():
            if os.path.exists(os.path.join(path, key)):
                with open(os.path.join(path, key), "w") as handle:
                    handle.write(str(value))
            elif key == "memory.oom_control":  # deprecated in v1: gone from a later kernel
                unkillable = True
        yield os.path.join(path, "cgroup.procs"), unkillable
    finally:
        os.rmdir(path)


_CREATE_IN_CGROUP = """
import os, sys
from shminfer.queue import QueueError, Segment, _mem_available
procs, unkillable = sys.argv[1], sys.argv[2] == "1"
if unkillable:
    with open("/proc/self/oom_score_adj", "w") as handle:
        handle.write("-1000")
    with open("/proc/self/oom_score_adj") as handle:
        if handle.read().strip() != "-1000":
            sys.exit("SKIP: oom_score_adj -1000 does not hold here")
with open(procs, "w") as handle:  # after the imports: only the segment counts in there
    handle.write(str(os.getpid()))
try:
    Segment.create("falloc", slot_count=64, request_bytes=1 << 20, response_bytes=1 << 20)
except QueueError as exc:
    print("refused", _mem_available(), exc)
else:
    print("created")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a memory cgroup")
def test_a_segment_its_cgroup_cannot_hold_fails_at_posix_fallocate_not_later():
    """The host has the memory (MemAvailable lets the segment through) but the unit's
    MemoryMax= (a memory cgroup's limit) has not: posix_fallocate fails, and the error says
    so and what to lower, at start, not a SIGBUS at a first touch later."""
    limit = 32 << 20  # the segment: 64 slots x (1 MiB + 1 MiB) + the ring, ~129 MiB
    with _memory_cgroup(limit) as (procs, unkillable):
        run = subprocess.run(
            [sys.executable, "-c", _CREATE_IN_CGROUP, procs, "1" if unkillable else "0"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    if run.stderr.startswith("SKIP: "):
        pytest.skip(run.stderr.strip()[6:])
    # Killed (-9) would be the OOM killer: the allocation did not fail, it was not let fail.
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr[-2000:])
    outcome, available, message = [*run.stdout.strip().split(" ", 2), "", ""][:3]
    assert outcome == "refused", f"a segment over its cgroup's limit: {run.stdout}"
    assert int(available) > 4 * (129 << 20), "MemAvailable would refuse it first"
    assert "cannot allocate" in message and "(Cannot allocate memory)" in message, message
    assert "memory available" not in message, message
    assert "lower --slots, --request-bytes or --response-bytes" in message, message


# ---------------------------------------------------------------- 4: registry and names


def test_the_registry_temp_file_never_follows_a_planted_symlink(tmp_path):
    name = f"h{uuid.uuid4().hex[:10]}"
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    victim.chmod(0o644)
    make_unit_dir(name)  # as root, or a user the directory's mode once let in
    os.symlink(victim, registry_path(name) + ".tmp")
    try:
        with serving(name=name, server_options={"group": "root"}):
            assert stat.S_IMODE(os.stat(unit_dir(name)).st_mode) == 0o751
            assert stat.S_IMODE(os.stat(registry_path(name)).st_mode) == 0o640
            assert stat.S_IMODE(os.stat(socket_path(name)).st_mode) == 0o660
            # Group members connect to the 0660 socket (it was refused as "group-writable").
            with Client(name, timeout=5) as client:
                assert np.all(client.infer(_x(3.0), timeout=20)["y"] == 3.0)
            os.chmod(socket_path(name), 0o666)
            with pytest.raises(QueueError, match="writable by group or others"):
                Client(name, timeout=2)
            os.chmod(socket_path(name), 0o660)
            assert victim.read_text() == "precious\n"
            assert stat.S_IMODE(victim.stat().st_mode) == 0o644
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(registry_path(name) + ".tmp")
    assert victim.read_text() == "precious\n"


def test_a_client_refuses_a_rewritten_or_planted_registry_and_socket(tmp_path):
    with serving(slots=4) as server:
        path = registry_path(server.name)
        with open(path) as handle:
            good = json.load(handle)
        bad = dict(good, workers=[{"cpu": 0, "segment": "../../etc/shadow"}])
        for data, mode, message in (
            (bad, 0o640, "not this server's"),
            (dict(good, socket="../../tmp/evil.sock"), 0o640, "not this server's"),
            (good, 0o664, "writable by group"),
        ):
            with open(path, "w") as handle:
                json.dump(data, handle)
            os.chmod(path, mode)
            with pytest.raises(QueueError, match=message):
                read_registry(server.name)
        os.chown(path, 65534, -1)
        os.chmod(path, 0o640)
        with pytest.raises(QueueError, match="not a trusted server user"):
            read_registry(server.name)
        os.unlink(path)
        os.symlink(tmp_path / "elsewhere.json", path)
        with pytest.raises(QueueError, match="symlink"):
            read_registry(server.name)
        os.unlink(path)
        # A socket at the name that is not the server's: a regular file, or a stranger's.
        sock = socket_path(server.name)
        os.rename(sock, sock + ".real")
        try:
            with open(sock, "w") as handle:
                handle.write("x")
            with pytest.raises(QueueError, match="not a socket"):
                Client(server.name, timeout=2)
            os.unlink(sock)
            os.link(sock + ".real", sock)
            os.chown(sock, 65534, -1)
            with pytest.raises(QueueError, match="not a trusted server user"):
                Client(server.name, timeout=2)
            os.chown(sock, 0, -1)
            with Client(server.name, timeout=5) as client:
                assert np.all(client.infer(_x(9.0), timeout=20)["y"] == 9.0)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(sock)
            os.rename(sock + ".real", sock)


# ---------------------------------------------------------------- 6: hangs


def test_a_hung_backend_is_killed_at_the_batch_deadline_and_the_slot_returns():
    with (
        serving(
            backend="sleep", model="1e9", slots=2, server_options={"batch_deadline_s": 1}
        ) as server,
        Client(server.name, slots_per_worker=1, timeout=30) as client,
    ):
        client.wait_ready(60)
        pending = client.start(_x(1.0))
        t0 = time.monotonic()
        with pytest.raises(InferenceError, match=r"batch exceeded deadline 1s; worker restarted"):
            client.finish(pending)
        assert time.monotonic() - t0 < 20
        assert client.lanes[0].free == [pending.slot]  # the slot is back
        wait_for(lambda: server.restarts[server.cpus[0]] >= 1, 20, "a restart")


def _encoded_request(client, value, enqueue_ns):
    lane = client.lanes[0]
    slot = lane.free.pop()
    length = Encoder().encode_into(lane.requests[slot], _x(value))
    seq = (lane.generation[slot] << 32) | 0x7777
    lane.seg.slot_set(slot, "request_len", length)
    lane.seg.slot_set(slot, "seq", seq)
    lane.seg.slot_set(slot, "enqueue_ns", enqueue_ns)
    lane.seg.state_words[slot] = 2
    lane.seg.ring_doorbell()
    return Pending(0, slot, seq, time.monotonic() + 20)


def test_a_far_future_enqueue_time_does_not_stall_the_worker():
    with (
        serving(slots=4, min_batch=4, max_wait_us=2000) as server,
        Client(server.name, slots_per_worker=4) as client,
    ):
        client.wait_ready(60)
        pending = _encoded_request(client, 11.0, 2**64 - 1)
        assert np.all(client.finish(pending, timeout=10)["y"] == 11.0)
        assert np.all(client.infer(_x(12.0), timeout=10)["y"] == 12.0)


def test_a_silent_peer_connection_stalls_nobody_and_client_timeouts_hold(tmp_path):
    with serving(slots=4) as server:
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        silent.connect(socket_path(server.name))
        silent.send(b'{"slots": 1')  # and never the end of the line
        try:
            with Client(server.name, timeout=5) as client:
                assert np.all(client.infer(_x(13.0), timeout=10)["y"] == 13.0)
        finally:
            silent.close()
    # A server that accepts and never answers: Client() gives up within its timeout.
    name = f"h{uuid.uuid4().hex[:10]}"
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    make_unit_dir(name)
    mute.bind(socket_path(name))
    os.chmod(socket_path(name), 0o600)
    mute.listen(4)
    try:
        t0 = time.monotonic()
        with pytest.raises(QueueError, match="no answer"):
            Client(name, timeout=0.5)
        assert time.monotonic() - t0 < 10
    finally:
        mute.close()
        os.unlink(socket_path(name))


def _serve_cli(name, *extra):
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "shminfer.cli", "serve", "--name", name),
            *("--cpus", str(CPUS[-1]), "--numa-node", "-1", "--backend", "echo"),
            *("--sched", "off", *extra),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_servers_of_one_name_started_together_exactly_one_runs():
    for _ in range(3):
        name = f"h{uuid.uuid4().hex[:10]}"
        procs = [_serve_cli(name), _serve_cli(name)]
        try:
            with _lease(name, timeout=60) as client:
                client.wait_ready(60)
                wait_for(lambda ps=procs: any(p.poll() is not None for p in ps), 30, "an exit")
                loser = next(p for p in procs if p.poll() is not None)
                winner = next(p for p in procs if p is not loser)
                err = loser.communicate(timeout=10)[1]
                assert loser.returncode == 2, err
                assert "already running" in err and "Traceback" not in err
                assert len(err.strip().splitlines()) == 1, err
                # The loser removed nothing of the winner's.
                assert os.path.exists(registry_path(name)) and os.path.exists(socket_path(name))
                assert np.all(client.infer(_x(14.0), timeout=10)["y"] == 14.0)
                assert winner.poll() is None
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(30)
        assert not os.path.exists(registry_path(name))


def test_killing_the_supervisor_says_server_stopped_and_clients_reattach():
    name = f"h{uuid.uuid4().hex[:10]}"
    first = _serve_cli(name, "--backend", "sleep", "--model", "500")
    second = None
    try:
        client = None
        deadline = time.monotonic() + 60
        while client is None:
            try:
                client = Client(name, timeout=10)
            except QueueError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.wait_ready(60)
        pending = client.start(_x(15.0))
        time.sleep(0.1)
        first.kill()
        first.wait(10)
        t0 = time.monotonic()
        with pytest.raises(ServerStopped, match=f"server {name} stopped"):
            client.finish(pending)
        assert time.monotonic() - t0 < 5
        second = _serve_cli(name)
        deadline = time.monotonic() + 60
        while True:
            try:
                out = client.infer(_x(16.0), timeout=10)
                break
            except (ServerStopped, QueueError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        assert np.all(out["y"] == 16.0)
        client.close()
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)


# ---------------------------------------------------------------- 7: clear CLI errors


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--request-bytes", "0"), "--request-bytes must be 64.."),
        (("--request-bytes", "lots"), "--request-bytes takes an integer"),
        (("--metrics-port", "70000"), "--metrics-port must be 0..65535"),
        (("--backend", "numpy", "--model", "/nonexistent/mlp.npz"), "cannot read"),
        (("--backend", "numpy"), "needs --model"),
    ],
)
def test_serve_refuses_bad_flags_before_starting(extra, message):
    name = f"h{uuid.uuid4().hex[:10]}"
    proc = _serve_cli(name, *extra)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert message in err and "Traceback" not in err, err
    assert "worker_ready" not in err and "worker_died" not in err
    assert not os.path.exists(registry_path(name))


def test_serve_with_a_busy_metrics_port_is_one_clear_line():
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        name = f"h{uuid.uuid4().hex[:10]}"
        proc = _serve_cli(name, "--metrics-port", str(busy.getsockname()[1]))
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2 and "--metrics-port" in err and "Traceback" not in err, err
        assert not os.path.exists(registry_path(name))
    finally:
        busy.close()
