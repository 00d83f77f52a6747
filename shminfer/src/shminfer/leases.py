"""Leases: the supervisor's unix socket, where clients attach (issue 12) and where one
hostile peer must not take the unit from the others (issue 27).

A client connects to the server's socket, sends one line, ``{"slots": N}``
(limits.parse_lease), and receives the segments' memfds (SCM_RIGHTS) with the geometry
and its slots; the connection stays open for the lease's life and its slots return to
the pool when it closes, each once the worker is not using it. One lease per connection;
whatever a peer sends, the lease thread answers that peer one line and drops it, never
dying itself. Connections are capped below the open-file limit (limits.connection_cap),
a connection that sends no line within HANDSHAKE_S is dropped, and running out of
descriptors pauses accept instead of ending it. No lock is shared with clients."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import selectors
import socket
import struct
import time

from shminfer.limits import MAX_LINE, parse_lease
from shminfer.queue import FREE, READY
from shminfer.registry import segment_name
from shminfer.worker import log_event

PROTOCOL = 2
HANDSHAKE_S = 10.0  # a connection that has not sent its lease line by then is dropped
_ACCEPT_PAUSE_S = 0.1  # out of descriptors (EMFILE/ENFILE): accept again after this


class _Conn:
    """One client connection: at most one lease, answered once (a second line gets one
    refusal and changes nothing); its slots come back when it closes."""

    __slots__ = ("answered", "buf", "leases", "pid", "refused", "since", "sock")

    def __init__(self, sock):
        self.sock = sock
        self.buf = b""
        self.leases = {}  # cpu -> [slot]
        self.pid = 0
        self.since = time.monotonic()
        self.answered = False
        self.refused = False


class Leases:
    """The lease half of Server (a mixin): the state it keeps is the Server's
    (``_holder``, ``_generation``, ``_conns``, ``_lease_mutex``, ``claims``, ...)."""

    def _leasable(self, cpu, index):
        """Slot ``index`` holds nothing anybody may still write an answer into: no READY
        request the worker is yet to claim, and not held by the worker. Ownership decides,
        not the state word, which is a peer's to scribble: the claim is the worker's own
        record (private memory), so a peer that rewrites the state word of a slot the
        worker holds cannot get it freed and leased to another client, and a PROCESSING
        the worker never wrote (a departed peer's) does not keep the slot from the pool.
        The state is read before the claim: the worker stores its claim before
        PROCESSING, so a PROCESSING read here finds the claim."""
        if int(self.segments[cpu].states[index]) == READY:
            return False
        return not self.claims[cpu][index]

    def _serve_leases(self, listener):
        """The lease thread. Every handler of a peer's input catches everything: that peer
        gets one line and is dropped, the thread goes on (issue 27)."""
        selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ, None)
        self._accept_paused = 0.0  # monotonic time accept resumes after EMFILE/ENFILE
        next_sweep = 0.0
        try:
            while not self._stop.is_set():
                for key, _ in selector.select(timeout=0.1):
                    if key.data is None:
                        try:
                            self._accept(selector, listener)
                        except Exception as exc:  # never the thread's end
                            log_event("accept_failed", name=self.name, error=repr(exc)[:300])
                        continue
                    try:
                        self._readable(selector, key.data)
                    except Exception as exc:  # a peer's input, whatever it is
                        self._peer_failed(selector, key.data, exc)
                now = time.monotonic()
                if self._accept_paused and now >= self._accept_paused:
                    self._accept_paused = 0.0
                    selector.register(listener, selectors.EVENT_READ, None)
                if now >= next_sweep:
                    next_sweep = now + 1.0
                    self._drop_silent(selector, now)
        except (OSError, ValueError):  # the listener closed under us at stop
            pass
        finally:
            for conn in list(self._conns.values()):
                self._drop(selector, conn)
            selector.close()

    def _accept(self, selector, listener):
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                log_event("accept_failed", name=self.name, error=str(exc))
                return
            # Out of descriptors: wait and retry, never exit (the connection cap keeps
            # clients below the limit; this is everything else using descriptors).
            log_event("accept_paused", name=self.name, error=exc.strerror, pause_s=_ACCEPT_PAUSE_S)
            selector.unregister(listener)
            self._accept_paused = time.monotonic() + _ACCEPT_PAUSE_S
            return
        conn = _Conn(sock)
        try:
            sock.setblocking(False)
            # The kernel's word for the client's pid, in this server's pid namespace: what
            # a client says is its own namespace's (a container's pid 1) or a lie.
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            conn.pid = struct.unpack("3i", creds)[0]
        except OSError:
            sock.close()
            return
        # The cap sits under the open-file limit; the health check's own client is always
        # let in, so a flood of connections is refused, not mistaken for a sick unit.
        if len(self._conns) >= self.max_connections and conn.pid != os.getpid():
            self._say(
                conn,
                f"server {self.name}: too many connections ({len(self._conns)}, its cap under "
                "the open-file limit); try again later",
            )
            sock.close()
            return
        self._conns[sock.fileno()] = conn
        selector.register(sock, selectors.EVENT_READ, conn)

    def _say(self, conn, error):
        """One line of refusal, if the peer's buffer takes it; never blocks."""
        with contextlib.suppress(OSError):
            conn.sock.send(json.dumps({"ok": False, "error": error}).encode() + b"\n")

    def _peer_failed(self, selector, conn, exc):
        log_event("lease_peer_dropped", name=self.name, pid=conn.pid, error=repr(exc)[:300])
        self._say(conn, f"bad request: {type(exc).__name__}")
        self._drop(selector, conn)

    def _drop_silent(self, selector, now):
        """Drop connections that have not sent their lease line within HANDSHAKE_S."""
        for conn in list(self._conns.values()):
            if not conn.answered and now - conn.since > HANDSHAKE_S:
                self._say(conn, f"no lease line within {HANDSHAKE_S:g} s")
                self._drop(selector, conn)

    def _readable(self, selector, conn):
        try:
            data = conn.sock.recv(MAX_LINE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(selector, conn)
            return
        if conn.answered:
            # One lease per connection: a second line is refused once, changes nothing,
            # and anything after it is read and ignored until the connection closes.
            if not conn.refused:
                conn.refused = True
                self._say(conn, "one lease per connection: this one is answered already")
            return
        conn.buf += data
        if b"\n" not in conn.buf:
            if len(conn.buf) > MAX_LINE:
                self._reply(selector, conn, {"ok": False, "error": "bad request: line too long"})
            return
        line = conn.buf.split(b"\n", 1)[0]
        conn.buf = b""
        try:
            count = min(parse_lease(line), self.slots)
        except (ValueError, RecursionError) as exc:
            self._reply(selector, conn, {"ok": False, "error": f"bad request: {exc}"})
            return
        refusal = None
        with self._lease_mutex:
            workers = []
            for cpu in self.cpus:
                slots = self._lease(cpu, conn, count)
                if count and not slots:
                    self._release(conn)
                    refusal = (
                        f"{segment_name(self.name, cpu)}: no free slot to lease (all held by "
                        "other clients or answering departed ones); start the server with more "
                        "--slots"
                    )
                    break
                workers.append(
                    {
                        "cpu": cpu,
                        "segment": segment_name(self.name, cpu),
                        "geometry": list(self.segments[cpu].geometry),
                        "slots": slots,
                    }
                )
        if refusal is not None:
            self._reply(selector, conn, {"ok": False, "error": refusal})
            return
        answer = {
            "ok": True,
            "name": self.name,
            "pid": os.getpid(),
            "instance": self.instance,
            "protocol": PROTOCOL,
            "workers": workers,
        }
        self._reply(selector, conn, answer, [self.segments[c].fd for c in self.cpus])

    def _reply(self, selector, conn, answer, fds=()):
        conn.answered = True
        raw = json.dumps(answer).encode() + b"\n"
        try:
            if fds:
                socket.send_fds(conn.sock, [raw], list(fds))
            else:
                conn.sock.send(raw)
        except OSError:
            self._drop(selector, conn)
            return
        if not answer.get("ok"):
            self._drop(selector, conn)

    def _lease(self, cpu, conn, count):
        """Up to ``count`` slots nobody holds and no former holder's request occupies."""
        segment = self.segments[cpu]
        holders = self._holder[cpu]
        leased = []
        for index in range(self.slots):
            if len(leased) == count:
                break
            if holders[index] is not None or not self._leasable(cpu, index):
                continue  # held, or a departed holder's request is still being answered
            segment.states[index] = FREE
            holders[index] = conn
            self._generation[cpu][index] = generation = (
                self._generation[cpu][index] + 1
            ) & 0xFFFFFFFF
            segment.slot_set(index, "generation", generation)
            segment.slot_set(index, "owner_pid", conn.pid or 1)
            leased.append([index, generation])
        if leased:
            conn.leases.setdefault(cpu, []).extend(index for index, _ in leased)
        return leased

    def _release(self, conn):
        for cpu, slots in (conn.leases or {}).items():
            segment = self.segments.get(cpu)
            for index in slots:
                if self._holder[cpu][index] is conn:
                    self._holder[cpu][index] = None
                    # A slot with a request in flight, or held by the worker, keeps its
                    # owner_pid (informational) until the answer is in and
                    # reclaim_dead_clients frees it.
                    if segment is not None and self._leasable(cpu, index):
                        segment.states[index] = FREE
                        segment.slot_set(index, "owner_pid", 0)
        conn.leases = {}

    def _drop(self, selector, conn):
        with self._lease_mutex:
            self._release(conn)
        with contextlib.suppress(KeyError, ValueError, OSError):
            selector.unregister(conn.sock)
        self._conns.pop(conn.sock.fileno(), None)
        conn.sock.close()

    def reclaim_dead_clients(self):
        """Free unleased slots whose last request has ended (a departed client's answer,
        or a scribble): they go back to the pool."""
        with self._lease_mutex:
            for cpu, segment in self.segments.items():
                holders = self._holder[cpu]
                states = segment.states
                for index in range(self.slots):
                    if holders[index] is None and self._leasable(cpu, index):
                        if int(states[index]) != FREE:
                            states[index] = FREE
                        if segment.owners[index]:
                            segment.slot_set(index, "owner_pid", 0)
