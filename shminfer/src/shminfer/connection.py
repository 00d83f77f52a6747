"""The client's side of the lease connection: connect to a unit's socket, check who
serves it, ask for slots and receive the segments (used by client.Client and the server's
health check)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import struct
import time

from shminfer.queue import QueueError, Segment
from shminfer.registry import (
    check_owner,
    check_unit_dir,
    not_in_group,
    read_registry,
    segment_name,
    socket_path,
)

_MAX_ANSWER = 1 << 16
_MAX_ERROR = 1024  # bytes of a worker's error text shown


def _printable(raw: bytes) -> str:
    """Error text from shared memory, safe to print: bounded, decoded, no control bytes."""
    text = raw[:_MAX_ERROR].decode("utf-8", "replace")
    return "".join(c if c.isprintable() else "?" for c in text) or "(no error text)"


def attach(name: str, slots_per_worker: int, timeout: float):
    """Connect to server ``name``, lease slots: (socket, answer, [Segment]).

    The socket must be the one the expected path names, owned by a trusted user, and its
    peer (SO_PEERCRED) that same user; the segments arrive as sealed memfds.
    """
    check_unit_dir(name)  # missing, not in the group, or a stranger's: one line each
    path = socket_path(name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        read_registry(name)  # the clearer message: no server of that name, or not ours
        raise QueueError(f"{path} is missing: is `shminfer serve --name {name}` running?") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise QueueError(f"{path} is not a socket (a symlink or file planted there?): refused")
    check_owner(st, path, group_may_write=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds = []
    try:
        sock.settimeout(max(timeout, 0.01))
        _connect(sock, name, path, st, time.monotonic() + max(timeout, 0.01))
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _peer_pid, peer_uid, _peer_gid = struct.unpack("3i", creds)
        if peer_uid != st.st_uid:
            raise QueueError(f"{path}: the server runs as uid {peer_uid}, not the socket's owner")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            # A server that refused at once (its connection cap) said why: read it below.
            sock.sendall(json.dumps({"slots": slots_per_worker}).encode() + b"\n")
        raw, fds, _flags, _addr = socket.recv_fds(sock, _MAX_ANSWER, 64)
        if not raw.endswith(b"\n"):
            raise QueueError(f"server {name}: truncated answer on {path}")
        answer = json.loads(raw)
        if not answer.get("ok"):
            raise QueueError(_printable(str(answer.get("error", "refused")).encode()))
        workers = answer["workers"]
        if len(fds) != len(workers):
            raise QueueError(f"server {name}: {len(fds)} segments for {len(workers)} workers")
        segments = []
        try:
            while fds:
                worker = workers[len(segments)]
                segments.append(
                    Segment.from_fd(
                        fds.pop(0), segment_name(name, worker["cpu"]), worker["geometry"]
                    )
                )
        except BaseException:
            for segment in segments:
                segment.close()
            raise
        sock.settimeout(None)
        sock.setblocking(False)
        return sock, answer, segments
    except socket.timeout:
        for fd in fds:
            os.close(fd)
        sock.close()
        raise QueueError(f"server {name}: no answer on {path} within {timeout} s") from None
    except (ValueError, KeyError, TypeError) as exc:
        for fd in fds:
            os.close(fd)
        sock.close()
        raise QueueError(f"server {name}: malformed answer on {path} ({exc})") from None
    except BaseException:
        for fd in fds:
            os.close(fd)
        sock.close()
        raise


def _connect(sock, name, path, st, deadline):
    """Connect, retrying while the server's listen backlog is full (EAGAIN on a unix
    socket) until ``deadline``; each failure is one line."""
    while True:
        try:
            sock.connect(path)
            return
        except PermissionError:
            raise QueueError(not_in_group(path, st.st_gid)) from None
        except (ConnectionRefusedError, FileNotFoundError):
            raise QueueError(f"server {name} is not running ({path} refuses connections)") from None
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise QueueError(
                    f"server {name}: its listen backlog is full ({path}: too many clients "
                    "connecting at once, or the server is not accepting); try again later"
                ) from None
            time.sleep(0.01)


def _closed(sock) -> bool:
    """True when the server's end of the lease connection has gone (EOF or error)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True
