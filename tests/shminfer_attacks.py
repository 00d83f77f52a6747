"""One hostile peer's attacks on a running shminfer unit (issue 27), the honest client that
checks every answer it gets, and the soak that runs them together.

Used by tests/unit/test_shminfer_dos.py (one attack per test), tests/unit/test_shminfer_soak.py
(a soak of seconds) and benchmarks/soak_shminfer.py (the 10-minute one). Also a program:
``python tests/shminfer_attacks.py honest NAME SECONDS TAG [MAX_REQUESTS]`` prints an honest
client's report, ``... attacker NAME SECONDS`` cycles through every attack."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
from shminfer_serving import attach

from shminfer import _sys
from shminfer.client import InferenceError
from shminfer.codec import PayloadError
from shminfer.queue import (
    PROCESSING,
    READY,
    S32,
    S32_REQUEST_LEN,
    S64,
    S64_ENQUEUE_NS,
    S64_SEQ,
    QueueError,
)
from shminfer.registry import socket_path

HERE = Path(__file__).resolve()
CPUS = sorted(os.sched_getaffinity(0))
WIDTH = 32  # the echo model's input width: x (1, 32) float64 in, y (1, 64) out

# Lease lines that once killed the lease thread or that it must refuse, one line each.
LEASE_LINES = {
    "huge-float": b'{"slots": 1e400}',
    "infinity": b'{"slots": Infinity}',
    "nan": b'{"slots": NaN}',
    "nested-2000": b"[" * 2000 + b"]" * 2000,
    "bool": b'{"slots": true}',
    "float": b'{"slots": 1.5}',
    "list": b"[1, 2]",
    "unknown-key": b'{"slots": 1, "owner": 0}',
    "not-utf8": b'{"slots": "\xff\xfe"}',
    "too-long": b'{"slots": 1' + b" " * 5000 + b"}",
}
# The word whose bytes hold READY one byte off the word boundary, before a FREE word.
MISALIGNED_READY = 0x02000000


# ------------------------------------------------------------------ raw lease connections


def connect(name):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(socket_path(name))
    return sock


def answer_line(sock, timeout=10.0):
    """One answer line from the server (fds that came with it are closed)."""
    sock.settimeout(timeout)
    raw, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 64)
    for fd in fds:
        os.close(fd)
    if not (raw.endswith(b"\n") and raw.count(b"\n") == 1):
        raise AssertionError(f"not one answer line: {raw[:200]!r}")
    return json.loads(raw)


def send_lease_line(name, line):
    """(the server's answer to one lease line, whether it then closed the connection)."""
    with connect(name) as sock:
        sock.sendall(line + b"\n")
        answer = answer_line(sock)
        return answer, sock.recv(1) == b""


def second_lease_line(name):
    """The answers to a lease line and to a second one on the same connection."""
    with connect(name) as sock:
        sock.sendall(b'{"slots": 1}\n')
        first = answer_line(sock)
        sock.sendall(b'{"slots": 8}\n')
        return first, answer_line(sock)


def flood(name, count):
    """``count`` connections that never send a lease line (close them when done)."""
    socks = []
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(socket_path(name))
        except OSError:
            sock.close()
            break
        socks.append(sock)
    return socks


# ------------------------------------------------------------------ through a client


def leave_with_state(name, word, slots=8):
    """Lease ``slots``, write ``word`` over each state word, leave (in this process)."""
    with attach(name, 30, slots_per_worker=slots, timeout=10) as client:
        lane = client.lanes[0]
        for slot in lane.leased:
            lane.seg.state_words[slot] = word
        return list(lane.leased)


def misaligned_ready(client):
    """Write MISALIGNED_READY into one of ``client``'s slots followed by a FREE word;
    (its slot, the worker's pid)."""
    lane = client.lanes[0]
    words = lane.seg.state_words
    slot = next(s for s in lane.free if s + 1 < lane.seg.slot_count and words[s + 1] == 0)
    words[slot] = MISALIGNED_READY
    return slot, lane.seg.get("worker_pid")


def overwrite_magic(client):
    for lane in client.lanes:
        lane.seg.mm[:8] = b"XXXXXXXX"


def bad_payloads(client):
    """What the reader refuses, sent by a client: {label: the exception it raised}."""
    width = np.zeros((1, WIDTH))
    cases = {
        "structured": {"x": np.zeros((1, 4), dtype=[("a", "<f4"), ("b", "<i4")])},
        "70000-arrays": {f"a{i}": width[0, :1] for i in range(70_000)},
        "int-key": {1: width},
    }
    raised = {}
    for label, inputs in cases.items():
        try:
            client.infer(inputs)
        except (PayloadError, TypeError, ValueError, InferenceError) as exc:
            raised[label] = exc
    return raised


def foreign_clock(client, value=1.0, stamp=1):
    """One request published by hand with enqueue stamp ``stamp`` (another time
    namespace's clock), answered; returns the slot's state word when it ended."""
    lane = client.lanes[0]
    seg = lane.seg
    slot = lane.free.pop()
    try:
        inputs = {"x": np.full((1, WIDTH), value)}
        length = lane.encoder.encode_into(lane.requests[slot], inputs, slot=slot)
        seg.slot32[slot * S32 + S32_REQUEST_LEN] = length
        seg.slot64[slot * S64 + S64_SEQ] = lane.generation[slot] << 32 | 0xFFFF
        seg.slot64[slot * S64 + S64_ENQUEUE_NS] = stamp
        seg.state_words[slot] = READY
        seg.ring_doorbell()
        deadline = time.monotonic() + 30
        while seg.state_words[slot] in (READY, PROCESSING) and time.monotonic() < deadline:
            time.sleep(0.001)
        return seg.state_words[slot]
    finally:
        seg.state_words[slot] = 0
        lane.free.append(slot)


# ------------------------------------------------------------------ the programs


def honest(name, seconds, tag, max_requests=None):
    """Requests until ``seconds`` pass (or ``max_requests``): each sends x = first + seq and
    checks the echo's y; the report says what each got (see check_outcomes)."""
    first = tag * 10_000_000
    received, delivered = [], []
    timeouts, timeout_s = 0, 0.0
    # An honest client starting while the peer's flood holds every connection retries.
    client = attach(name, 120, timeout=5, slots_per_worker=3)
    client.wait_ready(60)
    started = time.monotonic()
    until = started + seconds
    seq = 0
    while time.monotonic() < until and (max_requests is None or seq < max_requests):
        delivered.append(0)
        t0 = time.monotonic()
        try:
            y = client.infer({"x": np.full((1, WIDTH), float(first + seq))})["y"]
            uniform = y.shape == (1, 2 * WIDTH) and bool(np.all(y == y.flat[0]))
            owner = float(y.flat[0]) - first if uniform else -1.0
            if owner.is_integer() and 0 <= owner <= seq:
                delivered[int(owner)] += 1
            received.append("ok" if owner == seq else "WRONG")
        except (InferenceError, TimeoutError, QueueError) as exc:
            if isinstance(exc, TimeoutError):  # e.g. a peer scribbled PROCESSING over ours
                timeouts += 1
                timeout_s += time.monotonic() - t0
            text = str(exc)
            received.append("error" if text.isprintable() and 0 < len(text) <= 2048 else "GARBLED")
        seq += 1
    client.close()
    return {
        "received": received,
        "delivered": delivered,
        "path": _sys.IMPLEMENTATION,
        "timeouts": timeouts,
        "timeout_s": round(timeout_s, 1),
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def check_outcomes(report, at_least_ok=0.25):
    """An honest client's report: each request got exactly its own answer or a clear error.
    Every check is made and every one that fails is named."""
    received, delivered = report["received"], report["delivered"]
    n = len(received)
    assert len(delivered) == n, (len(received), len(delivered))
    errors = ("error", "GARBLED")
    problems = {
        "vanished (no answer of theirs came, no error)": [
            seq for seq in range(n) if delivered[seq] == 0 and received[seq] not in errors
        ],
        "answered twice": [seq for seq in range(n) if delivered[seq] > 1],
        "given another request's answer": [seq for seq in range(n) if received[seq] == "WRONG"],
        "an error not in clear text": [seq for seq in range(n) if received[seq] == "GARBLED"],
    }
    found = {check: seqs[:10] for check, seqs in problems.items() if seqs}
    assert not found, f"an honest client's requests: {found}"
    assert received.count("ok") >= n * at_least_ok, received.count("ok")


def attack_once(name, client):
    """Every attack of issue 27 a peer can make, once; {attack: what the unit said}."""
    said = {}
    for label, line in LEASE_LINES.items():
        answer, dropped = send_lease_line(name, line)
        said[f"line-{label}"] = (answer["ok"], dropped)
    said["second-line"] = second_lease_line(name)[1]["ok"]
    socks = flood(name, 600)
    try:
        refused = connect(name)
        with refused, contextlib.suppress(OSError, ValueError, AssertionError):
            # The unit may have refused and closed before the line: EPIPE, as for a client.
            refused.sendall(b'{"slots": 1}\n')
            said["flood"] = answer_line(refused, timeout=5).get("error", "")[:40]
    finally:
        for sock in socks:
            sock.close()
    leave_with_state(name, PROCESSING, slots=2)
    with attach(name, 30, slots_per_worker=2, timeout=10) as peer:
        said["misaligned"] = misaligned_ready(peer)[0]
    overwrite_magic(client)
    said["payloads"] = sorted(bad_payloads(client))
    said["foreign-clock"] = foreign_clock(client)
    return said


def attacker(name, seconds):
    """Cycle through every attack until ``seconds`` pass; prints how many rounds."""
    with attach(name, 120, slots_per_worker=2, timeout=10) as client:
        until = time.monotonic() + seconds
        rounds = 0
        while time.monotonic() < until:
            attack_once(name, client)
            rounds += 1
    return {"rounds": rounds}


# ------------------------------------------------------------------ the soak


def python(*args):
    return [sys.executable, str(HERE), *map(str, args)]


def serve(name, *extra, limit_nofile=None, stderr=None, slots=64):
    """`shminfer serve` of the echo model on the last CPU."""

    def limit():
        if limit_nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit_nofile, limit_nofile))

    return subprocess.Popen(
        [
            *(sys.executable, "-m", "shminfer.cli", "serve", "--name", name),
            *("--cpus", str(CPUS[-1]), "--numa-node", "-1", "--backend", "echo"),
            *("--model", str(WIDTH), "--sched", "off", "--slots", str(slots), *extra),
        ],
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        preexec_fn=limit,  # noqa: PLW1509 - setrlimit only, before exec
    )


def _usage(pid):
    """(open fds, threads) of process ``pid``."""
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def soak(seconds, honest_clients=8, kill_every_s=None, log=None):
    """A unit (soft RLIMIT_NOFILE 512: the flood reaches its cap), ``honest_clients``
    honest clients and one attacker for ``seconds``; the harness kills a worker every
    ``kill_every_s`` (None: never). Returns the figures; raises on a wrong answer."""
    name = f"soak{uuid.uuid4().hex[:8]}"
    slots = 64
    proc = serve(name, limit_nofile=512, stderr=log, slots=slots)
    honest_procs, attacker_proc, kills = [], None, 0
    try:
        with attach(name, 60) as probe:
            probe.wait_ready(60)
        time.sleep(1)  # the supervisor's own threads (health, lease) are up
        before = _usage(proc.pid)
        honest_procs = [
            subprocess.Popen(python("honest", name, seconds, tag), stdout=subprocess.PIPE)
            for tag in range(1, honest_clients + 1)
        ]
        attacker_proc = subprocess.Popen(python("attacker", name, seconds), stdout=subprocess.PIPE)
        deadline = time.monotonic() + seconds
        next_kill = time.monotonic() + (kill_every_s or seconds + 1)
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            if kill_every_s and time.monotonic() >= next_kill:
                next_kill += kill_every_s
                with (
                    attach(name, 60, slots_per_worker=1) as look,
                    contextlib.suppress(ProcessLookupError),
                ):
                    os.kill(look.lanes[0].seg.get("worker_pid"), signal.SIGKILL)
                    kills += 1
        reports = [json.loads(p.communicate(timeout=seconds + 300)[0]) for p in honest_procs]
        rounds = json.loads(attacker_proc.communicate(timeout=300)[0])["rounds"]
        serving = proc.poll() is None
        # Nothing leaked: every slot leasable by one client, answered; fds and threads back.
        with attach(name, 30, slots_per_worker=slots, timeout=10) as last:
            leased = len(last.lanes[0].leased)
            value = float(np.pi)
            answered = bool(np.all(last.infer({"x": np.full((1, WIDTH), value)})["y"] == value))
        time.sleep(1.5)
        after = _usage(proc.pid)
    finally:
        for child in [*honest_procs, *([attacker_proc] if attacker_proc else [])]:
            if child.poll() is None:
                child.kill()
            child.wait(30)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    requests = sum(len(r["received"]) for r in reports)
    errors = sum(r["received"].count("error") for r in reports)
    wrong = sum(r["received"].count("WRONG") + r["received"].count("GARBLED") for r in reports)
    return {
        "seconds": seconds,
        "path": reports[0]["path"] if reports else None,
        "honest_clients": honest_clients,
        "attack_rounds": rounds,
        "worker_kills": kills,
        "requests": requests,
        "wrong": wrong,
        "errors": errors,
        "error_rate": errors / requests if requests else None,
        "serving_at_end": serving and answered,
        "slots_leasable_at_end": f"{leased}/{slots}",
        "fds_before_after": [before[0], after[0]],
        "threads_before_after": [before[1], after[1]],
        "reports": reports,
    }


if __name__ == "__main__":
    role, unit, length = sys.argv[1], sys.argv[2], float(sys.argv[3])
    if role == "honest":
        limit = int(sys.argv[5]) if len(sys.argv) > 5 else None
        print(json.dumps(honest(unit, length, int(sys.argv[4]), limit)))
    elif role == "attacker":
        print(json.dumps(attacker(unit, length)))
    else:
        sys.exit(f"usage: {sys.argv[0]} honest|attacker NAME SECONDS [TAG [MAX_REQUESTS]]")
