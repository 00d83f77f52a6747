"""The supervisor behind `shminfer serve`: owns the segments, spawns and restarts workers,
leases slots to clients over a unix socket, reclaims slots of departed clients, kills a
worker whose batch overruns its deadline, serves metrics.

Leases are per connection (leases.py): a client connects to the unit's socket, asks for
N slots per worker and receives the segments' memfds (SCM_RIGHTS) with the geometry and
its slots; when the connection closes its slots return to the pool. The unit checks its
settings and its queues against its memory cgroup before it starts, and itself while it
runs (limits.py): a unit that cannot serve exits 2 for systemd to restart it. No lock is
shared with clients: nothing a peer holds can stall this loop."""

from __future__ import annotations

import contextlib
import ctypes
import grp
import multiprocessing
import multiprocessing.connection
import multiprocessing.reduction
import os
import secrets
import signal
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from shminfer import _sys
from shminfer.backends import BackendError, check_model
from shminfer.client import attach
from shminfer.leases import PROTOCOL, Leases
from shminfer.limits import (
    CGROUP_ROOT,
    HEALTH_ATTACH_TIMEOUT_S,
    HEALTH_EVERY_S,
    HEALTH_GRACE_S,
    HEALTH_STUCK_S,
    Health,
    check_queue_memory,
    check_settings,
    connection_cap,
)
from shminfer.metrics import SLOW_CPU_MS, SLOW_WALL_MS, collect, prometheus_text
from shminfer.queue import (
    PROCESSING,
    READY,
    WORKER_DEAD,
    WORKER_READY,
    WORKER_STARTING,
    WORKER_STOPPED,
    QueueError,
    Segment,
    fail_inflight,
)
from shminfer.registry import (
    NameLock,
    atomic_write,
    check_name,
    make_unit_dir,
    registry_path,
    remove_stale,
    segment_name,
    socket_name,
    socket_path,
    write_registry,
)
from shminfer.sdnotify import Notifier
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


LOAD_FAILED = 3  # the worker's exit code when the model does not load
UNHEALTHY = 2  # serve's exit code when its health check failed (systemd restarts it)


class _InheritFd:
    """An fd passed to a spawned worker: pickled as multiprocessing's DupFd, so the spawn
    keeps it open in the child under the same number."""

    def __init__(self, fd):
        self.fd = fd

    def __reduce__(self):
        return (_inherited, (multiprocessing.reduction.DupFd(self.fd),))


def _inherited(dup):
    return dup.detach()


def _check_options(cpus, slots, batch_deadline_s, worker_options, health):
    """Raise ValueError, one line, on options that cannot work together."""
    if not cpus:
        raise ValueError("at least one CPU is needed (--cpus)")
    if not batch_deadline_s or batch_deadline_s <= 0:
        raise ValueError(f"--batch-deadline-s must be > 0, got {batch_deadline_s}")
    # Every setting together, before anything starts: one line on what cannot work.
    check_settings(
        cpus=cpus,
        slots=slots,
        batch_deadline_s=batch_deadline_s,
        worker_options=worker_options or {},
        health=health,
    )


def _check_affinity(cpus):
    """Raise ValueError when ``cpus`` are not all in this process's affinity."""
    allowed = os.sched_getaffinity(0)
    outside = sorted(set(cpus) - allowed)
    if outside:
        raise ValueError(
            f"CPUs {outside} are outside this process's affinity {sorted(allowed)}: "
            "check --cpus against the unit's CPUAffinity"
        )


def _group_access(group):
    """(gid, file mode) of the unit's files: 0660 and that group's, else 0600."""
    if not group:
        return None, 0o600
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"group {group!r} does not exist") from None
    return gid, 0o660


class Server(Leases):
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
        batch_deadline_s=30.0,
        health=(HEALTH_EVERY_S, HEALTH_STUCK_S, HEALTH_GRACE_S),
        cgroup_root=CGROUP_ROOT,
    ):
        self.name = check_name(name)
        _check_options(cpus, slots, batch_deadline_s, worker_options, health)
        self.max_connections = connection_cap(len(cpus))
        self.health = Health(*health) if health[0] else None
        self.unhealthy = None  # why the health check gave up on this unit
        self.cgroup_root = cgroup_root
        _check_affinity(cpus)
        self.cpus = list(cpus)
        self.numa_node = numa_node
        self.backend = backend
        self.model = model
        self.slots = slots
        self.request_bytes = request_bytes
        self.response_bytes = response_bytes
        self.batch_deadline_s = float(batch_deadline_s)
        self.gid, self.mode = _group_access(group)
        self.worker_options = dict(worker_options or {})
        self.backoff_min, self.backoff_max = restart_backoff_s
        self._init_state()

    def _init_state(self):
        """What the running server keeps: segments, workers, leases, metrics, threads."""
        self.segments = {}
        self.processes = {}
        # cpu -> private [busy_since_ns, claims made, loaded] shared with that worker
        self.status = {}
        # cpu -> private u32 per slot, non-zero while that worker holds the slot (claimed,
        # not yet answered). Only the supervisor and the worker map it: a slot a worker
        # holds is never leased or freed, whatever its (peer-writable) state word says.
        self.claims = {}
        self.restarts = dict.fromkeys(self.cpus, 0)
        self.backoff = dict.fromkeys(self.cpus, self.backoff_min)
        self._spawned = {}  # cpu -> when its worker was last spawned (monotonic)
        self.load_failure = None
        self._kill_reason = {}
        self._stop = threading.Event()
        self._ctx = multiprocessing.get_context("spawn")
        self._http = None
        # node_exporter textfile (--metrics-textfile): path, period, when next due
        self.metrics_textfile = None
        self.metrics_every_s = 10.0
        self._metrics_due = 0.0
        self._metrics_failed = False
        self._lock = None
        self._listener = None
        self._lease_thread = None
        self._health_thread = None
        self._lease_mutex = threading.Lock()
        self._holder = {}  # cpu -> [conn or None] per slot
        self._generation = {}  # cpu -> [lease generation] per slot
        self._conns = {}
        self.instance = secrets.randbits(63)

    # ------------------------------------------------------------ lifecycle

    def start(self):
        """Check the model, take the name, create the queues, open the socket, spawn."""
        check_queue_memory(
            self.name,
            len(self.cpus),
            self.slots,
            self.request_bytes,
            self.response_bytes,
            root=self.cgroup_root,
        )
        make_unit_dir(self.name, self.gid)
        self._lock = NameLock(self.name)  # raises at once if another server has the name
        try:
            check_model(self.backend, self.model)
            removed = remove_stale(self.name)
            if removed:
                log_event("stale_files_removed", name=self.name, files=removed)
            for var in THREAD_ENV:
                os.environ[var] = "1"
            for cpu in self.cpus:
                self.segments[cpu] = Segment.create(
                    segment_name(self.name, cpu),
                    slot_count=self.slots,
                    request_bytes=self.request_bytes,
                    response_bytes=self.response_bytes,
                    numa_node=self.numa_node,
                    cpu=cpu,
                )
                self._holder[cpu] = [None] * self.slots
                self._generation[cpu] = [0] * self.slots
                self.status[cpu] = self._ctx.RawArray("q", 3)
                self.claims[cpu] = self._ctx.RawArray("I", self.slots)
            self._listen()
            write_registry(
                self.name,
                {
                    "name": self.name,
                    "pid": os.getpid(),
                    "pid_start": _sys.process_start_time(os.getpid()),
                    "numa_node": self.numa_node,
                    "protocol": PROTOCOL,
                    "socket": socket_name(self.name),
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

    def _listen(self):
        path = socket_path(self.name)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # created 0600: nobody connects before the chmod
        try:
            listener.bind(path)
        except OSError as exc:
            listener.close()
            raise QueueError(
                f"{path}: cannot listen ({exc.strerror}); is it another user's?"
            ) from None
        finally:
            os.umask(old_umask)
        if self.gid is not None:
            os.chown(path, -1, self.gid, follow_symlinks=False)
        os.chmod(path, self.mode)  # in our own directory: nobody can swap it meanwhile
        listener.listen(socket.SOMAXCONN)
        listener.setblocking(False)
        self._listener = listener
        self._lease_thread = threading.Thread(
            target=self._serve_leases,
            args=(listener,),
            name=f"shminfer-{self.name}-leases",
            daemon=True,
        )
        self._lease_thread.start()

    def _spawn(self, cpu):
        segment = self.segments[cpu]
        segment.set("worker_state", WORKER_STARTING)
        segment.set("worker_generation", segment.get("worker_generation") + 1)
        self.status[cpu][0] = self.status[cpu][2] = 0
        self._spawned[cpu] = time.monotonic()
        self._clear_claims(cpu)
        process = self._ctx.Process(
            target=worker_main,
            args=(segment_name(self.name, cpu), cpu, self.backend, self.model),
            kwargs={
                **self.worker_options,
                "geometry": segment.geometry,
                "segment_fd": _InheritFd(segment.fd),
                "status": self.status[cpu],
                "claims": self.claims[cpu],
            },
            name=f"shminfer-{self.name}-cpu{cpu}",
        )
        process.start()
        self.processes[cpu] = process

    def serve_forever(self, reclaim_every_s=0.1, notifier=None):
        next_restart = {}
        backoff = self.backoff
        tick = min(reclaim_every_s, 0.1)
        # systemd (Type=notify): "started" once every worker is ready; WATCHDOG=1 only while
        # this loop turns and the health check passes, so a wedged or sick unit restarts.
        notifier = notifier or Notifier({})
        announced = False
        if self.health is not None and self._health_thread is None:
            self._health_thread = threading.Thread(
                target=self._check_health, name=f"shminfer-{self.name}-health", daemon=True
            )
            self._health_thread.start()
        while not self._stop.is_set():
            if self.unhealthy is not None:
                log_event("unhealthy", name=self.name, reason=self.unhealthy, exit_code=UNHEALTHY)
                break
            notifier.watchdog()
            if not announced and all(
                s.get("worker_state") == WORKER_READY for s in self.segments.values()
            ):
                announced = notifier.ready("%d workers ready" % len(self.segments))
            sentinels = {p.sentinel: cpu for cpu, p in self.processes.items() if p is not None}
            ready = multiprocessing.connection.wait(list(sentinels), timeout=tick)
            for sentinel in ready:
                cpu = sentinels[sentinel]
                exitcode = self._worker_died(cpu)
                if exitcode == LOAD_FAILED and self.load_failure is None:
                    # The model does not load: restarting cannot help; stop, say why.
                    self.load_failure = f"the worker on CPU {cpu} could not load the model"
                    self._stop.set()
                next_restart[cpu] = time.monotonic() + backoff[cpu]
                backoff[cpu] = min(backoff[cpu] * 2, self.backoff_max)
            now = time.monotonic()
            for cpu, when in list(next_restart.items()):
                if now >= when and not self._stop.is_set():
                    del next_restart[cpu]
                    self.restarts[cpu] += 1
                    self._spawn(cpu)
            for cpu, process in self.processes.items():
                # A worker that loaded and has lived backoff_max since earns a fresh
                # backoff; a starting (or crash-looping) one does not: it keeps growing.
                if (
                    process is not None
                    and self.status[cpu][2]
                    and now - self._spawned[cpu] >= self.backoff_max
                ):
                    backoff[cpu] = self.backoff_min
            self.check_deadlines()
            self.reclaim_dead_clients()
            if self.metrics_textfile and now >= self._metrics_due:
                self._metrics_due = now + self.metrics_every_s
                self.write_metrics_textfile()

    def _check_health(self):
        """The health thread: one check every health.every_s; once they have failed for
        health.grace_s, ``unhealthy`` says why and serve_forever ends (exit 2)."""
        health = self.health
        while not self._stop.wait(health.every_s):
            reason = self.health_reason()
            if reason is not None and health.failing_since is None:
                log_event("health_check_failed", name=self.name, reason=reason)
            if health.record(reason):
                self.unhealthy = reason
                return

    def health_reason(self):
        """Why this unit is not serving, or None: its own client cannot attach, or a request
        sits READY for a loaded, idle worker that claims nothing (limits.Health)."""
        try:
            sock, _answer, segments = attach(self.name, 0, HEALTH_ATTACH_TIMEOUT_S)
        except (QueueError, OSError, ValueError) as exc:
            return f"the supervisor's own client cannot attach: {exc}"
        for segment in segments:
            segment.close()
        sock.close()
        now = time.monotonic()
        for cpu, segment in list(self.segments.items()):
            process = self.processes.get(cpu)
            alive = process is not None and process.is_alive()
            reason = self.health.stuck(cpu, segment, self.status[cpu], alive, now)
            if reason is not None:
                return reason
        return None

    def check_deadlines(self):
        """Kill a worker whose batch has run past --batch-deadline-s; it is restarted and
        that batch's clients get an error saying so."""
        now = time.monotonic_ns()
        limit = self.batch_deadline_s * 1e9
        for cpu, process in self.processes.items():
            busy_since = self.status[cpu][0]
            if process is None or not busy_since or now - busy_since <= limit:
                continue
            self._kill_reason[cpu] = (
                f"batch exceeded deadline {self.batch_deadline_s:g}s; worker restarted"
            )
            log_event("batch_deadline", cpu=cpu, pid=process.pid, deadline_s=self.batch_deadline_s)
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            self.status[cpu][0] = 0

    def _worker_died(self, cpu):
        process = self.processes[cpu]
        process.join(1)  # its sentinel fired: reaped at once, exitcode set
        segment = self.segments[cpu]
        segment.set("worker_state", WORKER_DEAD)
        reason = self._kill_reason.pop(cpu, None)
        failed = fail_inflight(
            segment,
            reason
            or f"worker on CPU {cpu} died (exit code {process.exitcode}) while processing this "
            "request; it is being restarted",
        )
        # The worker is gone: it writes into no slot any more, whatever it had claimed.
        self._clear_claims(cpu)
        log_event("worker_died", cpu=cpu, exitcode=process.exitcode, failed_requests=failed)
        self.processes[cpu] = None
        return process.exitcode

    def _clear_claims(self, cpu):
        claims = self.claims.get(cpu)
        if claims is not None:
            ctypes.memset(claims, 0, ctypes.sizeof(claims))

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
        if self._lock is not None and self._lock.fd is not None:
            # Only the name's holder removes its files: a server that lost the race for
            # the name never touches the winner's.
            for path in (socket_path(self.name), registry_path(self.name)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._lease_thread is not None:
            self._lease_thread.join(5)
            self._lease_thread = None
        if self._health_thread is not None:
            self._health_thread.join(HEALTH_ATTACH_TIMEOUT_S + 5)
            self._health_thread = None
        for segment in self.segments.values():
            segment.set("worker_state", WORKER_STOPPED)
            fail_inflight(segment, f"server {self.name} stopped", states=(READY, PROCESSING))
            segment.close()
        self.segments.clear()
        self.processes.clear()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if self._http is not None:
            self._http.shutdown()
            self._http = None
        if self.metrics_textfile:
            # Gone with the server: a scrape then sees no file (or the role's dangling
            # link, node_textfile_scrape_error 1), never figures of a server that stopped.
            with contextlib.suppress(OSError):
                os.unlink(self.metrics_textfile)

    # ------------------------------------------------------------ metrics

    def metrics_text(self) -> str:
        """The Prometheus exposition text of this server: the rings' percentiles, the
        worker restarts, how many workers are ready, and when this text was made."""
        ready = sum(1 for s in self.segments.values() if s.get("worker_state") == WORKER_READY)
        label = f'{{server="{self.name}"}}'
        per_cpu = collect(
            self.segments,
            self.worker_options.get("slow_cpu_ms", SLOW_CPU_MS),
            self.worker_options.get("slow_wall_ms", SLOW_WALL_MS),
        )
        return prometheus_text(self.name, per_cpu, restarts=self.restarts) + (
            "# HELP shminfer_workers_ready Workers of this server ready to serve.\n"
            "# TYPE shminfer_workers_ready gauge\n"
            f"shminfer_workers_ready{label} {ready}\n"
            "# HELP shminfer_workers Workers this server runs (one per CPU).\n"
            "# TYPE shminfer_workers gauge\n"
            f"shminfer_workers{label} {len(self.cpus)}\n"
            "# HELP shminfer_metrics_updated_timestamp_seconds When these figures were written.\n"
            "# TYPE shminfer_metrics_updated_timestamp_seconds gauge\n"
            f"shminfer_metrics_updated_timestamp_seconds{label} {time.time():.3f}\n"
        )

    def write_metrics_textfile(self) -> None:
        """Replace --metrics-textfile atomically (readable by node_exporter's user); a
        failure is logged once and retried at the next period, never fatal."""
        try:
            atomic_write(self.metrics_textfile, self.metrics_text(), 0o644)
        except OSError as exc:
            if not self._metrics_failed:
                log_event("metrics_textfile_failed", path=self.metrics_textfile, error=exc.strerror)
            self._metrics_failed = True
            return
        if self._metrics_failed:
            log_event("metrics_textfile_written", path=self.metrics_textfile)
        self._metrics_failed = False

    def serve_metrics(self, port, address="127.0.0.1"):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = server.metrics_text().encode()
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


def run_server(
    server: Server,
    metrics_port: int | None = None,
    metrics_textfile: str | None = None,
    metrics_every_s: float = 10.0,
) -> int:
    signal.signal(signal.SIGTERM, lambda *_: server._stop.set())
    signal.signal(signal.SIGINT, lambda *_: server._stop.set())
    if metrics_textfile:
        directory = os.path.dirname(os.path.abspath(metrics_textfile))
        if not os.path.isdir(directory):
            raise QueueError(
                f"--metrics-textfile {metrics_textfile}: {directory} is not a directory"
            )
        server.metrics_textfile = metrics_textfile
        server.metrics_every_s = metrics_every_s
    server.start()
    try:
        if metrics_port is not None:
            try:
                port = server.serve_metrics(metrics_port)
            except OSError as exc:
                raise QueueError(
                    f"--metrics-port {metrics_port}: cannot listen on 127.0.0.1 ({exc.strerror})"
                ) from None
            log_event("metrics_listening", address=f"127.0.0.1:{port}")
        log_event(
            "serving",
            name=server.name,
            cpus=server.cpus,
            numa_node=server.numa_node,
            backend=server.backend,
            registry=registry_path(server.name),
            socket=socket_path(server.name),
        )
        notifier = Notifier()
        try:
            server.serve_forever(notifier=notifier)
        finally:
            notifier.stopping()
    finally:
        server.stop()
    if server.load_failure:
        raise BackendError(server.load_failure + " (see worker_load_failed above)")
    if server.unhealthy:
        # The CLI's exit code 2 and this line, in the journal: systemd restarts the unit.
        raise QueueError(f"server {server.name} is unhealthy: {server.unhealthy}; exiting")
    return 0
