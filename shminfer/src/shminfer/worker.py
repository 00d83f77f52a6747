"""The inference worker: one process per CPU, pinned, one inference thread.

Started by the supervisor with the "spawn" start method (a fresh interpreter: no inherited
threads, locks or GIL state), it pins itself, loads the model with one thread, then loops:
claim READY slots (batching), run the backend, write responses, wake the clients. Idle, it
spins for ``spin_us`` and then sleeps on the segment's doorbell futex — never a fixed sleep
poll, and never spinning while a model runs.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from shminfer import _sys
from shminfer.answers import Answers
from shminfer.backends import BackendError, make_backend
from shminfer.codec import Decoder, Encoder, PayloadError
from shminfer.queue import (
    CPU_EXACT_NS,
    CPU_NOT_MEASURED,
    H32_DOORBELL,
    H32_WORKER_SLEEPING,
    PROCESSING,
    S32,
    S32_REQUEST_LEN,
    S64,
    S64_ENQUEUE_NS,
    S64_SEQ,
    S64_START_NS,
    WORKER_READY,
    Segment,
)
from shminfer.worker_process import SchedPolicy, _die_with_parent, log_event, threading_count

# A lost wake-up cannot hang the worker: the doorbell futex wait is bounded by this.
_SAFETY_WAIT_S = 0.05
# The CPU-time clocks are real syscalls (no vDSO, ~1 us each in a VM). Process CPU is
# read at the start of every batch and at its end whenever its wall time reached
# queue.CPU_EXACT_NS (0.1 ms, 10x below the smallest deschedule gate, the post-check's
# 1 ms): every such batch records its exact process CPU. A shorter batch records
# CPU_NOT_MEASURED; metrics count its wall time (< 0.1 ms) as its deschedule, an upper
# bound that can neither hide a deschedule nor push one past a gate. The thread clock
# (the process/thread CPU ratio only) is read around every THREAD_SAMPLE_EVERY-th batch.
# The C loop (shminfer._fast) takes a batch's start from a process-clock reading of the
# spin that found it when that is at most 0.01 ms old, off the request's path: exact but
# for a deschedule within those 0.01 ms (_fast.c, SPIN_CPU_MAX_AGE_NS).
THREAD_SAMPLE_EVERY = 16


def worker_main(
    segment_name: str,
    cpu: int,
    backend_name: str,
    model: str | None,
    *,
    threads: int = 1,
    min_batch: int = 1,
    max_batch: int = 16,
    max_wait_us: int = 0,
    spin_us: int = 50,
    sched: str = "infer",
    rt_priority: int = 10,
    slow_cpu_ms: float = 100.0,
    slow_wall_ms: float = 200.0,
    wait_mode: str = "futex",
    geometry=None,
    segment_fd=None,
    status=None,
    claims=None,
) -> None:
    """``segment_fd`` (inherited at spawn) and ``geometry`` come from the supervisor: the
    header is writable by every client. ``status`` and ``claims`` are private shared
    memory (not the segment, no client maps them): [busy_since_ns, claims made, loaded]
    for the supervisor's batch deadline watchdog and health check, and one u32 per slot,
    non-zero while this worker holds the slot (from its claim until it has answered),
    which the supervisor never leases."""
    _die_with_parent()
    if cpu >= 0:
        os.sched_setaffinity(0, {cpu})
    segment = Segment.from_fd(segment_fd, segment_name, geometry)
    try:
        backend = make_backend(backend_name)
        backend.load(model, threads)
    except BackendError as exc:
        log_event("worker_load_failed", cpu=cpu, error=str(exc))
        sys.exit(3)
    info = {"backend": backend_name, "model": model, **backend.describe()}
    segment.set_model_info(info)
    segment.set("worker_pid", os.getpid())
    segment.set("worker_state", WORKER_READY)
    if status is not None:
        status[2] = 1  # loaded: private, unlike worker_state (the health check reads it)
    policy = SchedPolicy(sched, rt_priority)
    log_event(
        "worker_ready",
        cpu=cpu,
        pid=os.getpid(),
        backend=backend_name,
        sched_fifo=policy.enabled,
        threads=threading_count(),
    )
    Worker(
        segment,
        backend,
        policy,
        min_batch=min_batch,
        max_batch=max_batch,
        max_wait_us=max_wait_us,
        spin_us=spin_us,
        slow_cpu_ms=slow_cpu_ms,
        slow_wall_ms=slow_wall_ms,
        wait_mode=wait_mode,
        cpu=cpu,
        status=status,
        claims=claims,
    ).run()


class Worker(Answers):
    def __init__(
        self,
        segment,
        backend,
        policy,
        *,
        min_batch,
        max_batch,
        max_wait_us,
        spin_us,
        slow_cpu_ms,
        slow_wall_ms,
        wait_mode,
        cpu,
        status=None,
        claims=None,
    ):
        self.seg = segment
        self.status = status
        # Slots this worker holds, in memory only it and the supervisor map: a peer that
        # rewrites a claimed slot's state word cannot get it leased to someone else while
        # this worker may still answer into it (see Server._leasable).
        if claims is None:
            claims = bytearray(4 * segment.slot_count)
        self.claims = memoryview(claims).cast("B").cast("I")
        self.backend = backend
        self.policy = policy
        self.min_batch = max(1, min_batch)
        self.max_batch = max(self.min_batch, max_batch)
        if not getattr(backend, "merge", True) and self.min_batch == 1:
            self.max_batch = 1  # see Backend.merge
        self.max_wait_ns = max_wait_us * 1000
        self.spin_ns = spin_us * 1000
        self.slow_cpu_ns = slow_cpu_ms * 1e6
        self.slow_wall_ns = slow_wall_ms * 1e6
        self.wait_mode = wait_mode
        self.cpu = cpu
        self.decoder = Decoder()
        self.encoder = Encoder()
        self.requests = [segment.request_view(i) for i in range(segment.slot_count)]
        self.responses = [segment.response_view(i) for i in range(segment.slot_count)]
        self.tags = [0] * segment.slot_count
        # Per slot: (decoded inputs, their batch size) and (the response slot's out views,
        # the batch size they fit), reused while the decoder hands back the same views.
        self._rows = [None] * segment.slot_count
        self._outs = [None] * segment.slot_count
        self._taught = [None] * segment.slot_count  # (views, out) the C loop has per slot
        self._batches = 0
        # SCHED_FIFO only while inferring: two sched_setscheduler calls around each batch.
        self._sched_switch = policy.enabled and policy.mode == "infer"
        self._loop = self._c_loop(claims, status)

    def _c_loop(self, claims, status):
        """The C serve step (shminfer._fast.loop) where it is built and fits the options:
        one READY request of a layout its slot had before, served and answered in C."""
        fast = _sys.FAST
        if fast is None or not hasattr(fast, "loop") or self.min_batch > 1 or self._sched_switch:
            return None
        seg = self.seg
        # An export of the mapping: the mmap cannot be closed while the loop may use it.
        keep = (memoryview(seg.mm), claims, status)
        return fast.loop(
            keep,
            _sys.address_of(seg.mm),
            len(seg.mm),
            seg.geometry,
            (seg.states_off, seg.table_off, seg.requests_off, seg.responses_off, seg.ring_off),
            _sys.address_of(claims),
            None if status is None else _sys.address_of(status),
            self.slow_wall_ns,
            self.slow_cpu_ns,
            self.max_batch == 1,
        )

    # ------------------------------------------------------------ waiting

    def _wait_for_work(self, spin=True):
        """Spin for ``spin_us`` (unless ``spin`` is False: the caller spun), then sleep on
        the doorbell until a client rings it."""
        seg = self.seg
        any_ready = seg.any_ready
        if self.wait_mode == "sleep":
            # The seed's design, kept only as the benchmark's baseline.
            while not any_ready():
                time.sleep(0.0005)
            return
        if spin and _sys.FAST is not None:
            if _sys.FAST.spin_ready(seg._state_addr0, seg.slot_count, self.spin_ns):
                return
        elif spin:
            clock = time.perf_counter_ns
            deadline = clock() + self.spin_ns
            while clock() < deadline:
                if any_ready():
                    return
        head = seg.head32
        doorbell = head[H32_DOORBELL]
        head[H32_WORKER_SLEEPING] = 1
        # Announce, fence, re-check: a client that stored READY before our fence is seen
        # by the re-check; one after it sees worker_sleeping=1 and wakes us (and if it
        # bumped the doorbell first, the futex wait returns at once: the value differs).
        _sys.full_fence()
        if not any_ready():
            _sys.futex_wait(seg.doorbell_addr, doorbell, _SAFETY_WAIT_S)
        head[H32_WORKER_SLEEPING] = 0

    def _claim(self):
        seg = self.seg
        ready = seg.ready_slots()
        if not ready:
            return []
        if len(ready) < self.min_batch and self.max_wait_ns:
            # enqueue_ns is a peer's word: a far-future one must not keep the worker
            # waiting (and spinning) for --min-batch; never wait past now + max_wait.
            now = time.monotonic_ns()
            oldest = min(now, *(seg.slot64[i * S64 + S64_ENQUEUE_NS] for i in ready))
            until = oldest + self.max_wait_ns
            while len(ready) < self.min_batch and time.monotonic_ns() < until:
                ready = seg.ready_slots()
        fields = seg.slot64
        if len(ready) > 1:
            # Oldest first, so a busy queue cannot starve a request.
            ready = [i for _, i in sorted((fields[i * S64 + S64_SEQ], i) for i in ready)]
        claimed = ready[: self.max_batch]
        words = seg.state_words
        tags = self.tags
        claims = self.claims
        for index in claimed:
            claims[index] = 1  # before PROCESSING: whoever sees PROCESSING sees the claim
            words[index] = PROCESSING
            # The request's tag, read once it is ours: every answer carries it back.
            tags[index] = fields[index * S64 + S64_SEQ]
        if self.status is not None:
            self.status[1] += len(claimed)  # progress, for the supervisor's health check
        return claimed

    # ------------------------------------------------------------ serving

    def run(self):
        loop = self._loop
        infer_into = self.backend.infer_into
        # The C loop spins for work itself (no Python between a READY and its claim).
        spin_ns = self.spin_ns if self.wait_mode != "sleep" else 0
        while True:
            if loop is not None:
                served = loop.serve(infer_into, spin_ns)
                if served is None:
                    self._wait_for_work(spin=False)
                    continue
                if served is not False:  # False: several READY, batched below
                    if type(served) is not int:
                        self._finish_c(served)
                    continue
            claimed = self._claim()
            if not claimed:
                self._wait_for_work()
                continue
            try:
                if len(claimed) == 1:
                    self._serve_one(claimed[0])
                else:
                    self._serve(claimed)
            except (
                Exception
            ) as exc:  # a bug or a peer's scribble must cost one batch, not the worker
                log_event("batch_failed", cpu=self.cpu, error=repr(exc)[:500])
                for index in claimed:
                    if self.seg.state_words[index] == PROCESSING:
                        self._fail(index, f"request failed in the worker: {exc!r}"[:500])
            # Every claimed slot is answered (or failed): nothing more is written into
            # them, so they may be leased again. After the answers' stores and fences.
            claims = self.claims
            for index in claimed:
                claims[index] = 0

    def _finish_c(self, served):
        """A slot the C loop claimed and handed back (see _fast.c, loop_serve)."""
        kind, index = served[0], served[1]
        if kind == 2:  # answered; slow
            self._log_slow(
                1,
                served[2],
                measured=served[3],
                cpu=served[4],
                thread=served[5],
                wall=served[6],
                queue_wait=served[7],
            )
            return
        try:
            self.tags[index] = served[2]
            if kind == 0:  # not of the layout the loop knows: the Python path from decode
                self._serve_one(index, served[3])
            else:  # the backend raised or answered elsewhere: encode as _run_group does
                _, _, _, start_ns, rows, outputs, exc, wall, cpu, thread, measured = served
                if exc is not None:
                    error = str(exc) if isinstance(exc, BackendError) else repr(exc)
                elif not isinstance(outputs, dict):
                    error = f"the backend returned {type(outputs).__name__}, not a dict"
                else:
                    error = None
                self._after_infer(
                    ((index, None, rows),),
                    start_ns,
                    out=None,
                    outputs=outputs,
                    error=error,
                    clocks=(wall, cpu, thread, measured),
                )
            self._teach(index)
        except Exception as exc:  # as in run(): one batch, not the worker
            log_event("batch_failed", cpu=self.cpu, error=repr(exc)[:500])
            if self.seg.state_words[index] == PROCESSING:
                self._fail(index, f"request failed in the worker: {exc!r}"[:500])
        self.claims[index] = 0

    def _teach(self, index):
        """Give the C loop this slot's validated request layout and response arrays."""
        cached = self.decoder.cached(self.requests[index], index)
        known = self._rows[index]
        if cached is None or known is None or known[0] is not cached[2]:
            self._loop.forget(index)
            self._taught[index] = None
            return
        out = self._out_views(index, known[1])
        taught = self._taught[index]
        if taught is not None and taught[0] is cached[2] and taught[1] is out:
            return
        header, total = (b"", 0)
        if out is not None:
            header, total = self.encoder.in_place_header(self.responses[index], index)
        self._loop.learn(index, cached[0], cached[1], cached[2], known[1], out, header, total)
        self._taught[index] = (cached[2], out)

    def _serve_one(self, index, start_ns=None):
        """One claimed request (the common case): _serve without the batch bookkeeping.
        ``start_ns``: the C loop stamped the start already."""
        seg = self.seg
        if start_ns is None:
            start_ns = time.monotonic_ns()
            seg.slot64[index * S64 + S64_START_NS] = start_ns
        try:
            inputs = self.decoder.decode(
                self.requests[index], seg.slot32[index * S32 + S32_REQUEST_LEN], slot=index
            )
            known = self._rows[index]
            if known is not None and known[0] is inputs:
                rows = known[1]  # the same views: the same shapes
            else:
                rows = _batch_rows(inputs)
                self._rows[index] = (inputs, rows)
        except PayloadError as exc:
            self._fail(index, f"bad request: {exc}")
            return
        except Exception as exc:  # whatever a peer wrote, it fails that slot only
            self._fail(index, f"bad request: {exc!r}")
            return
        self._run_group(((index, inputs, rows),), start_ns)

    def _serve(self, claimed):
        seg = self.seg
        start_ns = time.monotonic_ns()
        batch = []  # (slot, inputs, rows)
        fields = seg.slot64
        lengths = seg.slot32
        decode = self.decoder.decode
        for index in claimed:
            fields[index * S64 + S64_START_NS] = start_ns
            try:
                inputs = decode(
                    self.requests[index], lengths[index * S32 + S32_REQUEST_LEN], slot=index
                )
                batch.append((index, inputs, _batch_rows(inputs)))
            except PayloadError as exc:
                self._fail(index, f"bad request: {exc}")
            except Exception as exc:  # whatever a peer wrote, it fails that slot only
                self._fail(index, f"bad request: {exc!r}")
        if len(batch) == 1:
            self._run_group(batch, start_ns)
            return
        # Requests with the same signature are merged into one model call.
        groups = {}
        for entry in batch:
            signature = tuple((k, v.dtype, v.shape[1:]) for k, v in entry[1].items())
            groups.setdefault(signature, []).append(entry)
        for entries in groups.values():
            self._run_group(entries, start_ns)

    def _out_views(self, index, rows):
        """The response slot's arrays for the backend to write into (Backend.infer_into),
        when they are laid out for a batch of ``rows``; else None."""
        out = self.encoder.out_views(self.responses[index], index)
        if out is None:
            return None
        known = self._outs[index]
        if known is not None and known[0] is out:
            return out if known[1] == rows else None
        fits = all(a.ndim and a.shape[0] == rows for a in out.values())
        self._outs[index] = (out, rows if fits else -1)
        return out if fits else None

    def _run_group(self, entries, start_ns):
        if len(entries) == 1:
            index, merged, total_rows = entries[0]
            out = self._out_views(index, total_rows)
        else:
            try:
                merged = {
                    name: np.concatenate([e[1][name] for e in entries], axis=0)
                    for name in entries[0][1]
                }
            except (ValueError, TypeError, MemoryError):
                for entry in entries:  # cannot merge: one model call each
                    self._run_group([entry], start_ns)
                return
            total_rows = sum(e[2] for e in entries)
            out = None
        switch = self._sched_switch
        if switch:
            self.policy.busy()
        status = self.status
        if status is not None:
            status[0] = time.monotonic_ns()  # the watchdog's batch clock starts
        self._batches += 1
        sample_thread = not self._batches % THREAD_SAMPLE_EVERY
        # Both CPU clocks are read in the same order at both ends: their intervals are
        # the same length, and the process one brackets the wall one.
        cpu0 = time.process_time_ns()
        if sample_thread:
            thread0 = time.thread_time_ns()
        wall0 = time.perf_counter_ns()
        try:
            outputs = self.backend.infer_into(merged, out)
            error = None
            if type(outputs) is not dict and not isinstance(outputs, dict):
                raise BackendError(f"the backend returned {type(outputs).__name__}, not a dict")
        except BackendError as exc:
            outputs, error = None, str(exc)
        except Exception as exc:  # an engine's error for one batch
            outputs, error = None, repr(exc)
        wall = time.perf_counter_ns() - wall0
        if status is not None:
            status[0] = 0
        # Exact for every batch of CPU_EXACT_NS or more (and the thread-sampled ones).
        measured = wall >= CPU_EXACT_NS or sample_thread
        cpu = time.process_time_ns() - cpu0 if measured else CPU_NOT_MEASURED
        thread = time.thread_time_ns() - thread0 if sample_thread else CPU_NOT_MEASURED
        if switch:
            self.policy.idle()
        self._after_infer(
            entries,
            start_ns,
            out=out,
            outputs=outputs,
            error=error,
            clocks=(wall, cpu, thread, measured),
        )


def _batch_rows(inputs):
    """The batch size (first dimension) all of a request's inputs share."""
    rows = None
    for a in inputs.values():
        n = a.shape[0] if a.ndim else 1
        if rows is None:
            rows = n
        elif n != rows:
            raise PayloadError("inputs disagree on the batch size (first dimension)")
    if rows is None:
        raise PayloadError("inputs disagree on the batch size (first dimension)")
    return rows
