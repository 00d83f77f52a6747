"""The supervisor behind `shminfer serve`: owns the segments, spawns and restarts workers,
reclaims slots of dead clients, serves metrics."""

from __future__ import annotations

import contextlib
import grp
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from shminfer import _sys
from shminfer.metrics import collect, prometheus_text
from shminfer.queue import (
    PROCESSING,
    READY,
    WORKER_DEAD,
    WORKER_STARTING,
    WORKER_STOPPED,
    Segment,
    fail_inflight,
)
from shminfer.registry import (
    check_name,
    registry_path,
    remove_stale,
    segment_name,
    write_registry,
)
from shminfer.worker import log_event, worker_main

# Thread limits for every math library a backend may pull in; set before the spawned
# worker imports them.
THREAD_ENV = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "TBB_NUM_THREADS",
    "OV_CPU_THREADS_NUM",
)


class Server:
    def __init__(
        self,
        name,
        cpus,
        *,
        numa_node=-1,
        backend="numpy",
        model=None,
        slots=64,
        request_bytes=65536,
        response_bytes=65536,
        group=None,
        worker_options=None,
        restart_backoff_s=(0.1, 5.0),
    ):
        self.name = check_name(name)
        if not cpus:
            raise ValueError("at least one CPU is needed (--cpus)")
        allowed = os.sched_getaffinity(0)
        outside = sorted(set(cpus) - allowed)
        if outside:
            raise ValueError(
                f"CPUs {outside} are outside this process's affinity {sorted(allowed)}: "
                "check --cpus against the unit's CPUAffinity"
            )
        self.cpus = list(cpus)
        self.numa_node = numa_node
        self.backend = backend
        self.model = model
        self.slots = slots
        self.request_bytes = request_bytes
        self.response_bytes = response_bytes
        self.gid = None
        self.mode = 0o600
        if group:
            try:
                self.gid = grp.getgrnam(group).gr_gid
            except KeyError:
                raise ValueError(f"group {group!r} does not exist") from None
            self.mode = 0o660
        self.worker_options = dict(worker_options or {})
        self.backoff_min, self.backoff_max = restart_backoff_s
        self.segments = {}
        self.processes = {}
        self.restarts = dict.fromkeys(self.cpus, 0)
        self._stop = threading.Event()
        self._ctx = multiprocessing.get_context("spawn")
        self._http = None

    # ------------------------------------------------------------ lifecycle

    def start(self):
        removed = remove_stale(self.name)
        if removed:
            log_event("stale_segments_removed", name=self.name, files=removed)
        for var in THREAD_ENV:
            os.environ[var] = "1"
        try:
            for cpu in self.cpus:
                self.segments[cpu] = Segment.create(
                    segment_name(self.name, cpu),
                    slot_count=self.slots,
                    request_bytes=self.request_bytes,
                    response_bytes=self.response_bytes,
                    numa_node=self.numa_node,
                    cpu=cpu,
                    mode=self.mode,
                    gid=self.gid,
                )
            write_registry(
                self.name,
                {
                    "name": self.name,
                    "pid": os.getpid(),
                    "pid_start": _sys.process_start_time(os.getpid()),
                    "numa_node": self.numa_node,
                    "workers": [
                        {"cpu": c, "segment": segment_name(self.name, c)} for c in self.cpus
                    ],
                },
                self.mode,
                self.gid,
            )
            for cpu in self.cpus:
                self._spawn(cpu)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, cpu):
        segment = self.segments[cpu]
        segment.set("worker_state", WORKER_STARTING)
        segment.set("worker_generation", segment.get("worker_generation") + 1)
        process = self._ctx.Process(
            target=worker_main,
            args=(segment_name(self.name, cpu), cpu, self.backend, self.model),
            kwargs={**self.worker_options, "geometry": segment.geometry},
            name=f"shminfer-{self.name}-cpu{cpu}",
        )
        process.start()
        self.processes[cpu] = process

    def serve_forever(self, reclaim_every_s=0.5):
        next_restart = {}
        backoff = dict.fromkeys(self.cpus, self.backoff_min)
        while not self._stop.is_set():
            sentinels = {p.sentinel: cpu for cpu, p in self.processes.items() if p is not None}
            ready = multiprocessing.connection.wait(list(sentinels), timeout=reclaim_every_s)
            for sentinel in ready:
                cpu = sentinels[sentinel]
                self._worker_died(cpu)
                next_restart[cpu] = time.monotonic() + backoff[cpu]
                backoff[cpu] = min(backoff[cpu] * 2, self.backoff_max)
            now = time.monotonic()
            for cpu, when in list(next_restart.items()):
                if now >= when and not self._stop.is_set():
                    del next_restart[cpu]
                    self.restarts[cpu] += 1
                    self._spawn(cpu)
            for cpu, process in self.processes.items():
                # A worker that has served for a while earns a fresh backoff.
                if process is not None and process.is_alive() and cpu not in next_restart:
                    backoff[cpu] = max(self.backoff_min, backoff[cpu] / 2)
            self.reclaim_dead_clients()

    def _worker_died(self, cpu):
        process = self.processes[cpu]
        process.join(0)
        segment = self.segments[cpu]
        segment.set("worker_state", WORKER_DEAD)
        failed = fail_inflight(
            segment,
            f"worker on CPU {cpu} died (exit code {process.exitcode}) while processing this "
            "request; it is being restarted",
        )
        log_event("worker_died", cpu=cpu, exitcode=process.exitcode, failed_requests=failed)
        self.processes[cpu] = None

    def reclaim_dead_clients(self):
        """Free slots whose client process is gone (and whose request is not in flight)."""
        for segment in self.segments.values():
            segment.reclaim_orphaned()

    def stop(self, *_):
        self._stop.set()
        for process in self.processes.values():
            if process is not None and process.is_alive():
                process.terminate()
        for process in self.processes.values():
            if process is not None:
                process.join(5)
                if process.is_alive():
                    process.kill()
                    process.join()
        for segment in self.segments.values():
            segment.set("worker_state", WORKER_STOPPED)
            fail_inflight(segment, "server stopped", states=(READY, PROCESSING))
            segment.unlink()
            segment.close()
        self.segments.clear()
        self.processes.clear()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(registry_path(self.name))
        if self._http is not None:
            self._http.shutdown()
            self._http = None

    # ------------------------------------------------------------ metrics

    def serve_metrics(self, port, address="127.0.0.1"):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = prometheus_text(
                    server.name, collect(server.segments), restarts=server.restarts
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self._http = ThreadingHTTPServer((address, port), Handler)
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        return self._http.server_address[1]


def run_server(server: Server, metrics_port: int | None = None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: server._stop.set())
    signal.signal(signal.SIGINT, lambda *_: server._stop.set())
    server.start()
    try:
        if metrics_port is not None:
            port = server.serve_metrics(metrics_port)
            log_event("metrics_listening", address=f"127.0.0.1:{port}")
        log_event(
            "serving",
            name=server.name,
            cpus=server.cpus,
            numa_node=server.numa_node,
            backend=server.backend,
            registry=registry_path(server.name),
        )
        server.serve_forever()
    finally:
        server.stop()
    return 0
