"""The client: leases slots in every worker's segment and round-robins requests over them."""

from __future__ import annotations

import atexit
import itertools
import os
import time
import weakref

import numpy as np

from shminfer import _sys
from shminfer.codec import Decoder, Encoder, PayloadError
from shminfer.queue import (
    DONE,
    ERROR,
    FREE,
    PROCESSING,
    READY,
    WORKER_READY,
    WRITING,
    QueueError,
    Segment,
)
from shminfer.registry import read_registry

_SAFETY_WAIT_S = 0.05
_MAX_ERROR = 1024  # bytes of a worker's error text shown
_IN_FLIGHT = (READY, PROCESSING)


def _printable(raw: bytes) -> str:
    """Error text from shared memory, safe to print: bounded, decoded, no control bytes."""
    text = raw[:_MAX_ERROR].decode("utf-8", "replace")
    return "".join(c if c.isprintable() else "?" for c in text) or "(no error text)"


class InferenceError(RuntimeError):
    """The worker answered with an error (bad request, failed inference, worker died)."""


class Pending:
    __slots__ = ("deadline", "seq", "slot", "worker")

    def __init__(self, worker, slot, seq, deadline):
        self.worker = worker
        self.slot = slot
        self.seq = seq
        self.deadline = deadline


class _Lane:
    """One worker's segment as this client sees it: its leased slots and codecs."""

    def __init__(self, segment, slots):
        self.seg = segment
        self.generation = dict(slots)  # slot -> lease generation
        slots = [index for index, _ in slots]
        self.free = list(slots)
        self.leased = list(slots)
        self.abandoned = []
        self.requests = {i: segment.request_view(i) for i in slots}
        self.responses = {i: segment.response_view(i) for i in slots}
        self.encoder = Encoder()
        self.decoder = Decoder()

    def reclaim(self):
        states = self.seg.state_words
        keep = []
        for index in self.abandoned:
            # Not in flight: the worker is done with it (or a peer scribbled its state).
            if states[index] not in _IN_FLIGHT:
                states[index] = FREE
                self.free.append(index)
            else:
                keep.append(index)
        self.abandoned = keep


class Client:
    """Synchronous ``infer()`` and asynchronous ``start()``/``finish()`` over SHM.

    ``slots_per_worker`` bounds the requests this process can have in flight per worker.
    Responses are copied out by default; ``finish(copy=False)`` returns views into the
    slot that stay valid until the next request on that slot.
    """

    def __init__(
        self,
        name: str,
        *,
        timeout: float = 5.0,
        slots_per_worker: int = 4,
        spin_us: int = 50,
        wait_mode: str = "futex",
    ):
        registry = read_registry(name)
        self.name = name
        self.timeout = timeout
        self.spin_ns = spin_us * 1000
        self.wait_mode = wait_mode
        self.pid = os.getpid()
        start_time = _sys.process_start_time(self.pid)
        self.lanes = []
        try:
            for worker in registry["workers"]:
                segment = Segment.attach(worker["segment"])
                slots = segment.lease_slots(slots_per_worker, self.pid, start_time)
                if not slots:
                    segment.close()
                    raise QueueError(
                        f"{worker['segment']}: no free slot to lease (all held by other clients); "
                        "start the server with more --slots"
                    )
                self.lanes.append(_Lane(segment, slots))
        except BaseException:
            self.close()
            raise
        self._rr = itertools.cycle(range(len(self.lanes)))
        self._seq = itertools.count(1)
        self._finalizer = weakref.finalize(self, Client._release, self.lanes, self.pid)
        atexit.register(self._finalizer)

    @property
    def model(self):
        return self.lanes[0].seg.model_info() if self.lanes else None

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until every worker has loaded its model."""
        deadline = time.monotonic() + timeout
        while not all(lane.seg.get("worker_state") == WORKER_READY for lane in self.lanes):
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers of {self.name!r} not ready after {timeout} s")
            time.sleep(0.01)

    # ------------------------------------------------------------ requests

    def start(self, inputs: dict, timeout: float | None = None) -> Pending:
        timeout = self.timeout if timeout is None else timeout
        lane_index = None
        for _ in range(len(self.lanes)):
            candidate = next(self._rr)
            lane = self.lanes[candidate]
            if not lane.free and lane.abandoned:
                lane.reclaim()
            if lane.free:
                lane_index = candidate
                break
        if lane_index is None:
            raise QueueError("no free slot: every leased slot has a request in flight")
        lane = self.lanes[lane_index]
        seg = lane.seg
        words = seg.state_words
        slot = lane.free.pop()
        words[slot] = WRITING
        try:
            length = lane.encoder.encode_into(lane.requests[slot], inputs, slot=slot)
        except PayloadError as exc:
            words[slot] = FREE
            lane.free.append(slot)
            raise PayloadError(
                f"request refused: {exc}; send smaller batches or start the server with a "
                "larger --request-bytes"
            ) from None
        except BaseException:
            words[slot] = FREE
            lane.free.append(slot)
            raise
        # The request tag: the slot's lease generation and a per-client counter. The worker
        # echoes it with the answer; an answer under another tag is someone else's.
        seq = (lane.generation[slot] << 32) | (next(self._seq) & 0xFFFFFFFF)
        seg.slot_set(slot, "request_len", length)
        seg.slot_set(slot, "seq", seq)
        seg.slot_set(slot, "enqueue_ns", time.monotonic_ns())
        words[slot] = READY
        seg.ring_doorbell()
        return Pending(lane_index, slot, seq, time.monotonic() + timeout)

    def _wait(self, lane, slot, deadline):
        states = lane.seg.state_words
        if self.wait_mode == "sleep":
            while states[slot] in _IN_FLIGHT:
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.0005)
            return states[slot]
        clock = time.perf_counter_ns
        spin_until = clock() + self.spin_ns
        while clock() < spin_until:
            state = states[slot]
            if state not in _IN_FLIGHT:
                return state
        addr = lane.seg.state_addr(slot)
        waiters = lane.seg.waiters
        while True:
            waiters[slot] = 1
            state = states[slot]
            if state not in _IN_FLIGHT:
                waiters[slot] = 0
                return state
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                waiters[slot] = 0
                return None
            _sys.futex_wait(addr, state, min(remaining, _SAFETY_WAIT_S))

    def finish(self, pending: Pending, timeout: float | None = None, copy: bool = True) -> dict:
        lane = self.lanes[pending.worker]
        seg = lane.seg
        slot = pending.slot
        deadline = pending.deadline if timeout is None else time.monotonic() + timeout
        state = self._wait(lane, slot, deadline)
        if state is None:
            lane.abandoned.append(slot)
            raise TimeoutError(
                f"request {pending.seq} to {seg.path} got no answer in time "
                f"(slot state {seg.state_words[slot]}); the slot is reclaimed when it ends"
            )
        if state not in (DONE, ERROR):
            # Only the worker ends a request, with DONE or ERROR: anything else is a scribble.
            lane.abandoned.append(slot)
            raise InferenceError(
                f"request {pending.seq:#x} to {seg.path}: its slot's state word became "
                f"{state:#x}, not an answer (another process wrote over it); refused"
            )
        length = seg.slot_get(slot, "response_len")
        answered = seg.slot_get(slot, "response_seq")
        if answered != pending.seq:
            seg.state_words[slot] = FREE
            lane.free.append(slot)
            raise InferenceError(
                f"request {pending.seq:#x} to {seg.path}: the response in its slot answers "
                f"another request ({answered:#x}); refused"
            )
        if state == ERROR:
            message = _printable(bytes(lane.responses[slot][: min(length, _MAX_ERROR)]))
            seg.state_words[slot] = FREE
            lane.free.append(slot)
            raise InferenceError(message)
        try:
            outputs = lane.decoder.decode(lane.responses[slot], length, slot=slot)
        except PayloadError as exc:
            seg.state_words[slot] = FREE
            lane.free.append(slot)
            raise InferenceError(f"request {pending.seq:#x}: undecodable response: {exc}") from None
        if copy:
            outputs = {name: np.array(value) for name, value in outputs.items()}
        seg.state_words[slot] = FREE
        lane.free.append(slot)
        return outputs

    def infer(self, inputs: dict, timeout: float | None = None) -> dict:
        return self.finish(self.start(inputs, timeout))

    # ------------------------------------------------------------ teardown

    @staticmethod
    def _release(lanes, pid):
        if os.getpid() != pid:
            return
        for lane in lanes:
            try:
                lane.requests.clear()
                lane.responses.clear()
                lane.seg.release_slots(lane.leased, pid)
                lane.seg.close()
            except (OSError, ValueError):
                pass
        lanes.clear()

    def close(self):
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        else:
            Client._release(getattr(self, "lanes", []), self.pid)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
