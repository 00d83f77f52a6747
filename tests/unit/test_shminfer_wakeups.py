"""Lost wake-ups: thousands of round trips in which both sides sleep every time.

Each round trip crosses both of shminfer's sleep/wake handshakes: the worker sleeps on the
segment's doorbell (announce worker_sleeping, fence, re-check the states, futex wait; the
client stores READY, bumps the doorbell, fences, and wakes it if it announced) and the
client sleeps on its slot's state word (waiter flag, fence, re-check, futex wait; the worker
stores DONE, fences, wakes it if flagged). Spinning is off on both sides (spin_us=0), the
worker on one CPU and the client on another, so every request and every answer goes
through a handshake. A lost wake-up is a wait that ran to its timeout although the peer
had rung: the worker's with a request READY (or the doorbell moved), the client's with its
answer there. Both sides count those, with the safety timeouts shortened, and there must
be none. The Makefile runs this file on the C path and again on the pure-Python one
(SHMINFER_PURE=1).
"""

from __future__ import annotations

import ctypes
import functools
import multiprocessing
import os
import time

import numpy as np
import pytest
from shminfer_serving import serving

from shminfer import _sys
from shminfer import client as client_module
from shminfer import server as server_module
from shminfer import worker as worker_module
from shminfer.client import Client
from shminfer.queue import PROCESSING, READY, Segment

CPUS = sorted(os.sched_getaffinity(0))
ROUNDS = 20000
BUDGET_S = 3.0  # the rounds stop here on a slow machine; at least MIN_ROUNDS must be done
MIN_ROUNDS = 2000
# The safety timeouts of the worker's doorbell wait and the client's slot wait (50 ms in
# production), here too long for a scheduling delay to end a wait by coincidence with the
# peer's ring, and short enough that a lost wake-up costs little.
SAFETY_S = 0.25


def _word(address):
    return ctypes.c_uint32.from_address(address).value


def _watched_worker(stall_log, sleeps, safety_s, *args, **kwargs):
    """The worker process (spawned by the Server in place of worker_main): the real worker,
    with a short doorbell safety wait, its waits counted in ``sleeps`` and every wait that
    timed out although the client had rung (a request READY, or the doorbell moved) written
    to ``stall_log``."""
    worker_module._SAFETY_WAIT_S = safety_s
    segments = []
    from_fd = Segment.from_fd

    def watched_from_fd(*a, **k):
        segments.append(from_fd(*a, **k))
        return segments[-1]

    Segment.from_fd = watched_from_fd  # this process is the test's: it ends with it
    wait = _sys.futex_wait

    def futex_wait(address, expected, timeout_s):
        sleeps.value += 1
        woke = wait(address, expected, timeout_s)
        if not woke and (_word(address) != expected or segments[-1].any_ready()):
            with open(stall_log, "a") as log:
                log.write("worker: slept %.2f s with a request READY\n" % timeout_s)
        return woke

    _sys.futex_wait = futex_wait
    worker_module.worker_main(*args, **kwargs)


@pytest.mark.skipif(len(CPUS) < 2, reason="a lost wake-up is a race between two CPUs")
def test_no_lost_wake_ups_when_both_sides_sleep_every_round_trip(monkeypatch, tmp_path):
    stall_log = tmp_path / "stalls"
    stall_log.touch()
    worker_sleeps = multiprocessing.get_context("spawn").RawValue("q", 0)
    monkeypatch.setattr(
        server_module,
        "worker_main",
        functools.partial(_watched_worker, str(stall_log), worker_sleeps, SAFETY_S),
    )
    monkeypatch.setattr(client_module, "_SAFETY_WAIT_S", SAFETY_S)
    client_stalls = []
    client_sleeps = 0
    wait = _sys.futex_wait

    def futex_wait(address, expected, timeout_s):
        nonlocal client_sleeps
        client_sleeps += 1
        woke = wait(address, expected, timeout_s)
        if not woke and _word(address) not in (READY, PROCESSING):
            client_stalls.append("client: slept %.2f s with its answer there" % timeout_s)
        return woke

    monkeypatch.setattr(_sys, "futex_wait", futex_wait)
    affinity = os.sched_getaffinity(0)
    rounds = 0
    with serving(cpus=CPUS[-1:], model="8", spin_us=0) as server:
        try:
            with Client(server.name, spin_us=0, timeout=10) as client:
                client.wait_ready(60)
                os.sched_setaffinity(0, {CPUS[0]})  # this thread only; the worker has CPUS[-1]
                deadline = time.monotonic() + BUDGET_S
                while rounds < ROUNDS and time.monotonic() < deadline:
                    value = float(rounds)
                    y = client.infer({"x": np.full((1, 8), value, np.float32)})["y"]
                    assert y.shape == (1, 16) and np.all(y == value), rounds
                    rounds += 1
        finally:
            os.sched_setaffinity(0, affinity)
    stalls = [*stall_log.read_text().splitlines(), *client_stalls]
    sleeps = {"worker": worker_sleeps.value, "client": client_sleeps}
    print(
        f"wake-ups ({_sys.IMPLEMENTATION}): {rounds} round trips, sleeps {sleeps}, "
        f"{len(stalls)} lost"
    )
    assert not stalls, f"{len(stalls)} lost wake-ups in {rounds} round trips: {stalls[:5]}"
    assert rounds >= MIN_ROUNDS, f"only {rounds} round trips in {BUDGET_S} s"
    # Both handshakes were exercised: each side slept in most round trips (here: >= 1/4).
    assert min(sleeps.values()) >= rounds // 4, sleeps
