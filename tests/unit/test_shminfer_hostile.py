"""shminfer against unlucky and hostile peers (issue 12): on real processes and real shared
memory, each test fails (or would hang, bounded by its timeouts) without the fix it covers."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from shminfer.client import Client, InferenceError
from shminfer.queue import PROCESSING, QueueError
from shminfer.server import Server

CPUS = sorted(os.sched_getaffinity(0))


@contextlib.contextmanager
def serving(backend="echo", model=None, *, slots=8, name=None, server_options=None, **options):
    name = name or f"h{uuid.uuid4().hex[:10]}"
    server = Server(
        name,
        CPUS[-1:],
        numa_node=-1,
        backend=backend,
        model=model,
        slots=slots,
        request_bytes=65536,
        response_bytes=1 << 17,
        restart_backoff_s=(0.05, 0.5),
        worker_options={"sched": "off", **options},
        **(server_options or {}),
    )
    server.start()
    thread = threading.Thread(target=server.serve_forever, kwargs={"reclaim_every_s": 0.05})
    thread.start()
    try:
        yield server
    finally:
        server._stop.set()
        thread.join(30)
        server.stop()


def _x(value, rows=1, width=64):
    return {"x": np.full((rows, width), value, dtype=np.float32)}


def _wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def _lease(name, timeout=20.0, **kwargs):
    """A client, retrying while every slot is still in flight for someone else."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Client(name, **kwargs)
        except QueueError as exc:
            if "no free slot" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


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
c = Client(name, slots_per_worker=1, timeout=0.05)
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
        _wait_for(
            lambda: lane.seg.state_words[pending.slot] == PROCESSING, 10, "the worker's claim"
        )
        # A peer forges the request tag while the worker computes: the worker answers
        # with the tag it claimed, which is no longer the one the client expects.
        lane.seg.slot_set(pending.slot, "seq", pending.seq + 7)
        pending.seq += 7
        with pytest.raises(InferenceError, match="another request"):
            client.finish(pending, timeout=20)
        assert np.all(client.infer(_x(6.0), timeout=20)["y"] == 6.0)
