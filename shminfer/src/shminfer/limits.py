"""What one unit allows and checks (issue 27): its settings taken together, its queues
against its memory cgroup, its connection cap under the open-file limit, the lease line a
peer sends, and the supervisor's own health check.

Everything here runs before the unit starts (one clear line, nothing created) or inside
the supervisor on input a peer controls (a clear error for that peer, never an exception
that ends a thread)."""

from __future__ import annotations

import json
import os
import resource
import time

from shminfer.queue import MAX_SLOTS, QueueError, segment_bytes

# The open-file limit: the supervisor's own descriptors (listener, lock, registry, metrics,
# the interpreter's) and each worker's (its segment memfd, the process's pipes and
# sentinel) come off the soft RLIMIT_NOFILE; what is left is the client connection cap.
FD_RESERVE = 64
FD_PER_WORKER = 8

# Lease lines: one flat JSON object, {"slots": N}.
MAX_LINE = 4096
MAX_DEPTH = 2
MAX_LEASE_SLOTS = 1 << 20

# The supervisor's health check (serve --health-*): defaults generous enough for a lab VM
# under TCG emulation (5-20x slower); what they measure does not scale with CPU speed.
HEALTH_EVERY_S = 1.0
HEALTH_STUCK_S = 5.0
HEALTH_GRACE_S = 10.0
HEALTH_ATTACH_TIMEOUT_S = 5.0

CGROUP_ROOT = "/sys/fs/cgroup"


def check_settings(
    *,
    cpus,
    slots,
    batch_deadline_s,
    worker_options,
    health=(HEALTH_EVERY_S, HEALTH_STUCK_S, HEALTH_GRACE_S),
):
    """Refuse (ValueError, one line) settings that cannot work together, before anything
    starts: a batch that can never gather, a wait the batch deadline or the health check
    would cut short, a limit that leaves no room for a single client."""
    options = worker_options
    min_batch = options.get("min_batch", 1)
    max_batch = options.get("max_batch", 16)
    max_wait_s = options.get("max_wait_us", 0) / 1e6
    every_s, stuck_s, grace_s = health
    if not 1 <= slots <= MAX_SLOTS:
        raise ValueError(f"--slots must be 1..{MAX_SLOTS}, got {slots}")
    if min_batch < 1 or max_batch < 1:
        raise ValueError(f"--min-batch and --max-batch must be >= 1, got {min_batch}, {max_batch}")
    if min_batch > slots:
        raise ValueError(
            f"--min-batch {min_batch} can never gather: a worker has --slots {slots} "
            "(lower --min-batch or raise --slots)"
        )
    if min_batch > max_batch:
        raise ValueError(f"--min-batch {min_batch} is more than --max-batch {max_batch}")
    if max_wait_s < 0 or options.get("spin_us", 0) < 0:
        raise ValueError("--max-wait-us and --spin-us must be >= 0")
    if min_batch > 1 and max_wait_s >= batch_deadline_s:
        raise ValueError(
            f"--max-wait-us {options['max_wait_us']} is not below --batch-deadline-s "
            f"{batch_deadline_s:g}: a batch would wait past its deadline"
        )
    if min_batch > 1 and every_s and max_wait_s >= stuck_s:
        raise ValueError(
            f"--max-wait-us {options['max_wait_us']} is not below --health-stuck-s "
            f"{stuck_s:g}: a request waiting for its batch would look stuck"
        )
    if not 1 <= options.get("rt_priority", 10) <= 99:
        raise ValueError(f"--rt-priority must be 1..99, got {options.get('rt_priority')}")
    for flag in ("slow_cpu_ms", "slow_wall_ms"):
        if options.get(flag, 1.0) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {options[flag]}")
    if every_s < 0 or (every_s and (stuck_s <= every_s or grace_s < 0)):
        raise ValueError(
            f"--health-every-s {every_s:g} (0: off) needs --health-stuck-s above it and "
            f"--health-grace-s >= 0 (got {stuck_s:g}, {grace_s:g})"
        )
    connection_cap(len(cpus))


def connection_cap(workers: int) -> int:
    """Client connections a unit of ``workers`` accepts at once: the soft RLIMIT_NOFILE
    less FD_RESERVE and FD_PER_WORKER per worker; a limit that leaves none is refused."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    cap = soft - FD_RESERVE - FD_PER_WORKER * workers
    if cap < 1:
        raise ValueError(
            f"the open-file limit (RLIMIT_NOFILE {soft}) leaves no room for a client "
            f"connection with {workers} workers: raise it (LimitNOFILE=, the runtime role's "
            "rtfleet_runtime_limit_nofile)"
        )
    return cap


# ------------------------------------------------------------------ memory cgroup


def cgroup_memory_limit(root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup"):
    """(bytes, memory.max path) of the tightest memory.max on this process's cgroup v2
    path, from its own cgroup up to ``root``; None when there is none (no limit, or no
    cgroup v2 hierarchy)."""
    try:
        with open(proc_cgroup, encoding="utf-8") as handle:
            lines = handle.read(1 << 16).splitlines()
    except OSError:
        return None
    path = next((line[3:] for line in lines if line.startswith("0::")), None)
    if path is None:
        return None
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    tightest = None
    for depth in range(len(parts), -1, -1):
        limit_path = os.path.join(root, *parts[:depth], "memory.max")
        try:
            with open(limit_path, encoding="ascii") as handle:
                text = handle.read(64).strip()
        except (OSError, UnicodeDecodeError):
            continue
        if text.isascii() and text.isdigit() and (tightest is None or int(text) < tightest[0]):
            tightest = (int(text), limit_path)
    return tightest


def check_queue_memory(name, workers, slots, request_bytes, response_bytes, *, root=CGROUP_ROOT):
    """Refuse queues the unit's memory cgroup cannot hold (it would OOM-kill the server at
    start, silently, in a systemd restart loop)."""
    found = cgroup_memory_limit(root)
    if found is None:
        return
    limit, where = found
    need = workers * segment_bytes(slots, request_bytes, response_bytes)
    if need > limit:
        raise QueueError(
            f"server {name}: its queues need {need} bytes ({workers} workers x {slots} slots "
            f"x {request_bytes}+{response_bytes} bytes), more than the memory cgroup allows "
            f"({limit} bytes, {where}): lower --slots, --request-bytes or --response-bytes, "
            "or raise MemoryMax="
        )


# ------------------------------------------------------------------ the lease line


def _nesting(raw: bytes) -> int:
    """How deep the JSON in ``raw`` nests (brackets outside strings)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif byte in b"]}":
            depth -= 1
    return deepest


def _no_float(text):
    raise ValueError(f"slots must be an integer, got {text[:20]}")


def _no_constant(text):
    raise ValueError(f"{text} is not a slot count")


def parse_lease(line: bytes) -> int:
    """The slot count a lease line asks for: ``{"slots": N}``, N an integer 0..2**20.
    Anything else (another shape, a float, Infinity, NaN, deep nesting, a long line) is a
    ValueError whose text is the peer's one-line answer."""
    if len(line) > MAX_LINE:
        raise ValueError(f"line longer than {MAX_LINE} bytes")
    if _nesting(line) > MAX_DEPTH:
        raise ValueError(f'nested deeper than {MAX_DEPTH}: send {{"slots": N}}')
    request = json.loads(line, parse_float=_no_float, parse_constant=_no_constant)
    if not isinstance(request, dict) or set(request) - {"slots"}:
        raise ValueError('a lease line is {"slots": N}')
    count = request.get("slots", 0)
    if type(count) is not int or not 0 <= count <= MAX_LEASE_SLOTS:
        raise ValueError(f"slots must be an integer 0..{MAX_LEASE_SLOTS}")
    return count


# ------------------------------------------------------------------ health


class Health:
    """The supervisor's liveness: its own client can attach, and no request sits READY
    for ``stuck_s`` while its worker, loaded and not in a batch, claims nothing. A check
    that keeps failing for ``grace_s`` makes the unit sick (serve_forever then stops
    feeding the watchdog and the unit exits 2, saying why)."""

    def __init__(self, every_s=HEALTH_EVERY_S, stuck_s=HEALTH_STUCK_S, grace_s=HEALTH_GRACE_S):
        self.every_s, self.stuck_s, self.grace_s = every_s, stuck_s, grace_s
        self.failing_since = None
        self.reason = None
        self._ready = {}  # (cpu, slot) -> (claims counter, first seen) while READY

    def stuck(self, cpu, segment, status, alive, now):
        """A reason when a READY request of worker ``cpu`` has waited ``stuck_s`` for a
        worker that is loaded, idle and claims nothing (status: private, see
        Server.status); else None."""
        loaded = alive and status[2] and not status[0]
        claimed = status[1]
        seen = {}
        for index in segment.ready_slots() if loaded else ():
            count, since = self._ready.get((cpu, index), (claimed, now))
            if count != claimed:
                count, since = claimed, now  # the worker claimed since: not stuck
            seen[(cpu, index)] = (count, since)
        for key in [k for k in self._ready if k[0] == cpu]:
            del self._ready[key]
        self._ready.update(seen)
        for (_, index), (_, since) in seen.items():
            if now - since >= self.stuck_s:
                return (
                    f"a request has been READY for {now - since:.1f} s in slot {index} of the "
                    f"worker on CPU {cpu}, which is idle and claims nothing"
                )
        return None

    def record(self, reason, now=None):
        """The outcome of one check; True once checks have failed for grace_s."""
        now = time.monotonic() if now is None else now
        if reason is None:
            self.failing_since = self.reason = None
            return False
        if self.failing_since is None:
            self.failing_since = now
        self.reason = reason
        return now - self.failing_since >= self.grace_s
