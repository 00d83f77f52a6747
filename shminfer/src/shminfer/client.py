"""The client: leases slots in every worker's segment and round-robins requests over them."""

from __future__ import annotations

import atexit
import itertools
import os
import time
import weakref

import numpy as np

from shminfer import _sys
from shminfer.codec import Decoder, Encoder, PayloadError, TooLarge
from shminfer.connection import _MAX_ERROR, _closed, _printable, attach
from shminfer.queue import (
    DONE,
    ERROR,
    FREE,
    H32_WORKER_STATE,
    PROCESSING,
    READY,
    S32,
    S32_REQUEST_LEN,
    S32_RESPONSE_LEN,
    S32_WAITER,
    S64,
    S64_ENQUEUE_NS,
    S64_RESPONSE_SEQ,
    S64_SEQ,
    WORKER_READY,
    WRITING,
    QueueError,
)

_SAFETY_WAIT_S = 0.05
_GONE = -1  # _wait: the server went away
_IN_FLIGHT = (READY, PROCESSING)


class InferenceError(RuntimeError):
    """The worker answered with an error (bad request, failed inference, worker died)."""


class Pending:
    __slots__ = ("deadline", "lane", "seq", "slot", "worker")

    def __init__(self, worker, slot, seq, deadline, lane=None):
        self.worker = worker
        self.slot = slot
        self.seq = seq
        self.deadline = deadline
        self.lane = lane


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
        # slot -> (request view, response view, slot address, state word address): one
        # lookup a request on the Python encode path
        self.hot = {
            i: (
                self.requests[i],
                self.responses[i],
                segment.slot_addr(i),
                segment.state_addr(i),
            )
            for i in slots
        }
        self.encoder = Encoder()
        self.decoder = Decoder()
        self.port = _port(segment)

    def teach_send(self, slot):
        """Give the C port the layout the encoder just wrote to ``slot``."""
        cached = self.encoder.cached(self.requests[slot], slot)
        if cached is None:
            self.port.forget(slot)
            return
        spec, header, total, dests = cached
        self.port.learn_send(
            slot,
            tuple(name for name, _, _ in spec),
            tuple(dtype for _, dtype, _ in spec),
            tuple(shape for _, _, shape in spec),
            tuple(dests),
            header,
            total,
        )

    def teach_recv(self, slot):
        """Give the C port the response layout the decoder just validated for ``slot``."""
        cached = self.decoder.cached(self.responses[slot], slot)
        if cached is not None:
            self.port.learn_recv(slot, cached[0], cached[1], cached[2])

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


def _port(segment):
    """The C send/receive steps for this segment (shminfer._fast.port), where built."""
    fast = _sys.FAST
    # A build without Port.start (an older _fast) leaves the client on its Python steps.
    if fast is None or not hasattr(fast, "port") or not hasattr(fast.Port, "start"):
        return None
    # An export of the mapping: it stays mapped while the port may write or read it.
    return fast.port(
        (memoryview(segment.mm),),
        _sys.address_of(segment.mm),
        len(segment.mm),
        segment.geometry,
        (
            segment.states_off,
            segment.table_off,
            segment.requests_off,
            segment.responses_off,
            segment.ring_off,
        ),
        np.ndarray,
    )


class ServerStopped(InferenceError):
    """The server went away (stopped, killed or restarted) while this request was out."""


class Client:
    """Synchronous ``infer()`` and asynchronous ``start()``/``finish()`` over SHM.

    ``slots_per_worker`` bounds the requests this process can have in flight per worker.
    Responses are copied out by default; ``finish(copy=False)`` returns views into the
    slot that stay valid until the next request on that slot. When the server stops,
    requests out fail with :class:`ServerStopped` and the next ``start()`` attaches to a
    new server of the same name.
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
        self.name = name
        self.timeout = timeout
        self.spin_ns = spin_us * 1000
        self.wait_mode = wait_mode
        self.slots_per_worker = slots_per_worker
        self.pid = os.getpid()
        self.lanes = []
        self._sock = None
        self._stale = False  # the server went away: the next start() attaches anew
        self._seq = itertools.count(1)
        self._finalizer = None
        self.choice = None  # set by Client.nearest: which unit, and why
        self._attach()

    @classmethod
    def nearest(cls, *, cpus=None, match: str = "*", **options) -> Client:
        """A client of the unit (name matching the glob ``match``) nearest to this
        process's CPUs (or ``cpus``): one in its L3 group, else on its NUMA node, else on
        the nearest node, with a logged warning (:mod:`shminfer.locality`).
        ``client.choice`` says which and why."""
        from shminfer.locality import where  # noqa: PLC0415

        choice = where(cpus, match=match)
        client = cls(choice.name, **options)
        client.choice = choice
        return client

    def _attach(self):
        sock, _answer, segments = attach(self.name, self.slots_per_worker, self.timeout)
        workers = _answer["workers"]
        self._sock = sock
        self.lanes = [
            _Lane(segment, [tuple(s) for s in worker["slots"]])
            for segment, worker in zip(segments, workers)
        ]
        self._rr = itertools.cycle(range(len(self.lanes)))
        for index, lane in enumerate(self.lanes):
            if lane.port is not None:
                # Port.start/finish take and give back this lane's free slots themselves.
                lane.port.bind(
                    lane.free, lane.generation, self._seq, index, weakref.ref(lane), Pending
                )
        self._finalizer = weakref.finalize(self, Client._release, self.lanes, self.pid, sock)
        atexit.register(self._finalizer)

    def _server_gone(self) -> bool:
        return self._sock is None or _closed(self._sock)

    def _reattach(self):
        """The server this client leased from is gone: drop it, attach to the new one."""
        self.close()
        try:
            self._attach()
        except QueueError as exc:
            raise ServerStopped(f"server {self.name} stopped ({exc})") from None
        self._stale = False

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

    def _lane_with_a_free_slot(self, tried):
        """Index of the next lane (round robin, after ``tried``) with a free slot, reclaiming
        abandoned slots of a lane that has none."""
        lanes = self.lanes
        lane = lanes[tried]
        if lane.abandoned:
            lane.reclaim()
            if lane.free:
                return tried
        for _ in range(len(lanes) - 1):
            candidate = next(self._rr)
            lane = lanes[candidate]
            if not lane.free and lane.abandoned:
                lane.reclaim()
            if lane.free:
                return candidate
        raise QueueError("no free slot: every leased slot has a request in flight")

    def start(self, inputs: dict, timeout: float | None = None) -> Pending:
        lanes = self.lanes
        if lanes and not self._stale and _sys.FAST is not None:
            lane_index = next(self._rr)
            port = lanes[lane_index].port
            if port is not None:
                # The whole start in one C call (the slot off the free list, the tag, the
                # reuse test, copies and publish) when this lane's worker is READY and the
                # free slot's last layout is this request's; None: nothing was done.
                pending = port.start(inputs, self.timeout if timeout is None else timeout)
                if pending is not None:
                    return pending
            return self._start(inputs, timeout, lane_index)
        return self._start(inputs, timeout, None)

    def _start(self, inputs, timeout, lane_index):
        lanes = self.lanes
        if (
            self._stale
            or not lanes
            or (lanes[0].seg.head32[H32_WORKER_STATE] != WORKER_READY and self._server_gone())
        ):
            self._reattach()
            lanes = self.lanes
            lane_index = None
        if lane_index is None:
            lane_index = next(self._rr)
        lane = lanes[lane_index]
        if not lane.free:
            lane_index = self._lane_with_a_free_slot(lane_index)
            lane = lanes[lane_index]
        slot = lane.free.pop()
        # The request tag: the slot's lease generation and a per-client counter. The worker
        # echoes it with the answer; an answer under another tag is someone else's.
        seq = lane.generation[slot] << 32 | (next(self._seq) & 0xFFFFFFFF)
        fast = _sys.FAST
        port = lane.port if fast is not None else None
        if port is not None:
            # The layout this slot had last: reuse test, copies and publish in one C call.
            try:
                sent = port.send(slot, inputs, seq)
            except BaseException:
                lane.seg.state_words[slot] = FREE
                lane.free.append(slot)
                raise
            if sent is not None:
                deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
                return Pending(lane_index, slot, seq, deadline, lane)
        timeout = self.timeout if timeout is None else timeout
        seg = lane.seg
        words = seg.state_words
        request, _response, slot_addr, state_addr = lane.hot[slot]
        words[slot] = WRITING
        try:
            length = lane.encoder.encode_into(request, inputs, slot=slot)
            if port is not None:
                lane.teach_send(slot)  # the next request of this layout goes through port.send
        except PayloadError as exc:
            words[slot] = FREE
            lane.free.append(slot)
            hint = (
                "; send smaller batches or start the server with a larger --request-bytes"
                if isinstance(exc, TooLarge)
                else ""
            )
            raise PayloadError(f"request refused: {exc}{hint}") from None
        except BaseException:
            words[slot] = FREE
            lane.free.append(slot)
            raise
        if fast is not None:
            # request_len, seq, enqueue_ns, READY, doorbell: the same stores, in C.
            fast.publish(slot_addr, state_addr, seg.header_addr, length, seq)
            return Pending(lane_index, slot, seq, time.monotonic() + timeout, lane)
        seg.slot32[slot * S32 + S32_REQUEST_LEN] = length
        fields = seg.slot64
        fields[slot * S64 + S64_SEQ] = seq
        fields[slot * S64 + S64_ENQUEUE_NS] = time.monotonic_ns()
        words[slot] = READY
        seg.ring_doorbell()
        return Pending(lane_index, slot, seq, time.monotonic() + timeout, lane)

    def _wait(self, lane, slot, deadline, spin=True):
        """The slot's state once it is not in flight, None on timeout or _GONE. ``spin``:
        False when the caller spun already (Port.recv)."""
        states = lane.seg.state_words
        if self.wait_mode == "sleep":
            while states[slot] in _IN_FLIGHT:
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.0005)
            return states[slot]
        state = states[slot]
        if state not in _IN_FLIGHT:
            return state
        addr = lane.seg.state_addr(slot)
        if not spin:
            pass
        elif _sys.FAST is not None:
            state = _sys.FAST.spin_state(addr, self.spin_ns)
            if state not in _IN_FLIGHT:
                return state
        else:
            clock = time.perf_counter_ns
            spin_until = clock() + self.spin_ns
            while clock() < spin_until:
                state = states[slot]
                if state not in _IN_FLIGHT:
                    return state
        waiters = lane.seg.slot32
        waiter = slot * S32 + S32_WAITER
        while True:
            waiters[waiter] = 1
            # Store (waiters) -> load (state) must not be reordered, or the worker's
            # "publish DONE, then read waiters" can pass ours: see _sys.full_fence.
            _sys.full_fence()
            state = states[slot]
            if state not in _IN_FLIGHT:
                waiters[waiter] = 0
                return state
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                waiters[waiter] = 0
                return None
            if not _sys.futex_wait(addr, state, min(remaining, _SAFETY_WAIT_S)) and (
                self._server_gone()
            ):
                waiters[waiter] = 0
                return _GONE

    def finish(self, pending: Pending, timeout: float | None = None, copy: bool = True) -> dict:
        lane = pending.lane or self.lanes[pending.worker]
        if lane not in self.lanes:  # identity: _Lane has no __eq__
            self._stale = self._stale or not self.lanes
            raise ServerStopped(
                f"server {self.name} stopped while request {pending.seq:#x} was out "
                "(this client has attached to a new server since)"
            )
        seg = lane.seg
        slot = pending.slot
        spin = True
        port = lane.port if _sys.FAST is not None and self.wait_mode != "sleep" else None
        if port is not None:
            # Spin, state, tag and the decoder's reuse test in one C call: the views of an
            # answer to this request of the layout validated last (the slot then FREE and
            # back on the free list), or the state read last.
            answer = port.finish(slot, pending.seq, self.spin_ns)
            if type(answer) is dict:
                if copy:
                    return {name: np.array(value) for name, value in answer.items()}
                return answer
            spin = False
        deadline = pending.deadline if timeout is None else time.monotonic() + timeout
        state = self._wait(lane, slot, deadline, spin)
        if state is _GONE or (state is None and self._server_gone()):
            self._stale = True
            raise ServerStopped(
                f"server {self.name} stopped while request {pending.seq:#x} was out; "
                "the next request attaches to a new server of that name"
            )
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
        length = seg.slot32[slot * S32 + S32_RESPONSE_LEN]
        answered = seg.slot64[slot * S64 + S64_RESPONSE_SEQ]
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
            if message == f"server {self.name} stopped" and self._server_gone():
                self._stale = True
                raise ServerStopped(message)
            raise InferenceError(message)
        try:
            outputs = lane.decoder.decode(lane.hot[slot][1], length, slot=slot)
        except PayloadError as exc:
            seg.state_words[slot] = FREE
            lane.free.append(slot)
            raise InferenceError(f"request {pending.seq:#x}: undecodable response: {exc}") from None
        if port is not None:
            lane.teach_recv(slot)  # the next answer of this layout goes through port.recv
        if copy:
            outputs = {name: np.array(value) for name, value in outputs.items()}
        seg.state_words[slot] = FREE
        lane.free.append(slot)
        return outputs

    def infer(self, inputs: dict, timeout: float | None = None) -> dict:
        return self.finish(self.start(inputs, timeout))

    # ------------------------------------------------------------ teardown

    @staticmethod
    def _release(lanes, pid, sock):
        if os.getpid() != pid:
            return
        for lane in lanes:
            if lane.port is not None:
                lane.port.unbind()
            try:
                lane.requests.clear()
                lane.responses.clear()
                lane.hot.clear()
                lane.seg.close()
            except (OSError, ValueError):
                pass
        lanes.clear()
        # Closing the connection ends the lease: the server frees the slots, each once
        # no request of ours is in flight in it.
        sock.close()

    def close(self):
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        self.lanes = []
        self._sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
