"""A shminfer Server on this machine's last CPU, in a thread, for the shminfer test files."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid

from shminfer.client import Client
from shminfer.queue import QueueError
from shminfer.registry import registry_path, socket_path
from shminfer.server import Server

CPUS = sorted(os.sched_getaffinity(0))


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def attach(name, within, retry=None, pause=0.05, **options):
    """A Client of unit ``name``, retrying for ``within`` s while attaching fails with a
    QueueError that names one of ``retry`` (any QueueError when ``retry`` is None): the
    unit still coming up, every slot in flight, a flood's connections still open."""
    deadline = time.monotonic() + within
    while True:
        try:
            return Client(name, **options)
        except QueueError as exc:
            if retry is not None and not any(r in str(exc) for r in retry):
                raise
            if time.monotonic() > deadline:
                raise
            time.sleep(pause)


@contextlib.contextmanager
def serving(
    backend="echo",
    model=None,
    *,
    cpus=None,
    slots=32,
    name=None,
    prefix="t",
    request_bytes=65536,
    reclaim_every_s=0.1,
    server_options=None,
    check_cleanup=True,
    **worker_options,
):
    """Yield a started server; on the way out stop it and, with ``check_cleanup``, check it
    removed its files (tests that remove or replace them on purpose turn that off)."""
    name = name or f"{prefix}{uuid.uuid4().hex[:10]}"
    server = Server(
        name,
        cpus or CPUS[-1:],
        numa_node=-1,
        backend=backend,
        model=model,
        slots=slots,
        request_bytes=request_bytes,
        response_bytes=1 << 17,
        restart_backoff_s=(0.05, 0.5),
        worker_options={"sched": "off", **worker_options},
        **(server_options or {}),
    )
    server.start()
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"reclaim_every_s": reclaim_every_s}
    )
    thread.start()
    try:
        yield server
    finally:
        server._stop.set()
        thread.join(30)
        server.stop()
        if check_cleanup:
            assert not os.path.exists(registry_path(name))
            assert not os.path.exists(socket_path(name))
