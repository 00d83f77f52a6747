"""What a server publishes, and how peers find it without being fooled.

Every server has a directory of its own, ``RUN_DIR/NAME`` (RUN_DIR is ``$SHMINFER_DIR``,
else ``/run/shminfer``; the systemd unit's ``RuntimeDirectory=shminfer/%i`` makes it). It
is the server user's, so nobody else can create, swap or remove a file in it: 0700, or with
``--group`` 0751 and group-owned (others may reach a file they know the name of, such as
node_exporter the world-readable ``metrics.prom``, but not list; the registry and socket
are the group's). A Kubernetes pod mounts exactly RUN_DIR, read-only, instead of the
host's /dev/shm or its IPC namespace. In it:

``server.lock``    0600, flock(2)-held by the running server for its whole life: exactly
                   one server per name, and only the holder ever removes the other files.
``registry.json``  the registry (0640 with ``--group``, else 0600): pid, workers, socket.
``server.sock``    the unix socket clients connect to; the server leases slots over it and
                   hands the queue segments (sealed memfds) with SCM_RIGHTS. 0660 with
                   ``--group``. Connecting works through a read-only mount.

Writers never follow symlinks and create temp files O_EXCL under random names; readers
check that a trusted user owns the directory, open with O_NOFOLLOW and check, with fstat,
that a trusted user owns the file and that nobody else can write it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pwd
import re
import secrets
import stat

from shminfer import _sys
from shminfer.queue import QueueError

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_MAX_REGISTRY = 1 << 16
DEFAULT_DIR = "/run/shminfer"
REGISTRY, SOCKET, LOCK = "registry.json", "server.sock", "server.lock"


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise QueueError(
            f"server name {name!r} must be 1-64 letters, digits, '_' or '-' "
            "(it names the server's directory)"
        )
    return name


def run_dir() -> str:
    """Where servers publish: ``$SHMINFER_DIR``, else /run/shminfer."""
    path = os.environ.get("SHMINFER_DIR") or DEFAULT_DIR
    if not os.path.isabs(path):
        raise QueueError(f"SHMINFER_DIR={path!r} must be an absolute path")
    return path


def unit_dir(name: str) -> str:
    return os.path.join(run_dir(), check_name(name))


def registry_path(name: str) -> str:
    return os.path.join(unit_dir(name), REGISTRY)


def socket_name(name: str) -> str:
    check_name(name)
    return SOCKET


def socket_path(name: str) -> str:
    return os.path.join(unit_dir(name), SOCKET)


def lock_path(name: str) -> str:
    return os.path.join(unit_dir(name), LOCK)


def segment_name(name: str, cpu: int) -> str:
    return f"shminfer.{check_name(name)}.cpu{int(cpu)}"


def make_unit_dir(name: str, gid: int | None = None) -> str:
    """The server's own directory, made when missing (systemd's ``RuntimeDirectory=`` makes
    it for the unit): refused unless this user owns it; then 0751 and group ``gid`` with
    ``--group``, else 0700, so nobody else may create, swap or remove a file in it."""
    base, path = run_dir(), unit_dir(name)
    hint = (
        "run the server as its systemd unit (RuntimeDirectory=), or set SHMINFER_DIR "
        "to a directory this user may write"
    )
    try:
        os.makedirs(base, mode=0o755, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise QueueError(f"{path} is not a directory (a symlink or file?): remove it") from None
        raise QueueError(f"cannot make {path} ({exc.strerror}): {hint}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise QueueError(
                f"{path} belongs to uid {st.st_uid}, not this server's user "
                f"(uid {os.geteuid()}): remove it"
            )
        if gid is not None:
            os.fchown(fd, -1, gid)
        os.fchmod(fd, 0o751 if gid is not None else 0o700)
    finally:
        os.close(fd)
    return path


def check_unit_dir(name: str, trusted=None) -> str:
    """A client's view of ``RUN_DIR/NAME``: missing, unreadable (not in the group) or not a
    trusted user's own directory are each a one-line error saying what to fix."""
    base, path = run_dir(), unit_dir(name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not os.path.isdir(base):
            raise QueueError(missing_dir(base)) from None
        raise QueueError(f"no shminfer server named {name!r} ({path} is missing)") from None
    except PermissionError:
        raise QueueError(f"{base}: permission denied (it should be 0755)") from None
    if not stat.S_ISDIR(st.st_mode):
        raise QueueError(f"{path} is not a directory (a symlink or file planted there?): refused")
    check_owner(st, path, trusted)
    if not os.access(path, os.X_OK):
        raise QueueError(not_in_group(path, st.st_gid))
    return path


def not_in_group(path: str, gid: int) -> str:
    return (
        f"{path}: permission denied: this process (uid {os.getuid()}, groups "
        f"{sorted(os.getgroups())}) is not in the server's group {gid} "
        f"(a pod needs securityContext.supplementalGroups: [{gid}])"
    )


def _gid(path: str):
    try:
        return os.lstat(path).st_gid
    except OSError:
        return "?"


def missing_dir(base: str) -> str:
    return (
        f"{base} is missing: no shminfer server runs here (in a container, mount the host's "
        f"{DEFAULT_DIR} at {base}: a read-only hostPath volume; or set SHMINFER_DIR)"
    )


def list_names() -> list:
    """The names of the servers that have a directory in RUN_DIR (live or not), sorted:
    every entry whose name :func:`check_name` would accept."""
    try:
        entries = os.listdir(run_dir())
    except OSError:
        return []
    return sorted(e for e in entries if _NAME.match(e))


def trusted_uids() -> set:
    """Users whose servers a client believes: root, itself, the ``shminfer`` service user,
    and whoever ``SHMINFER_SERVER_USERS`` (comma-separated names or uids) names."""
    uids = {0, os.geteuid()}
    names = ["shminfer", *filter(None, os.environ.get("SHMINFER_SERVER_USERS", "").split(","))]
    for raw in names:
        entry = raw.strip()
        if entry.isdigit():
            uids.add(int(entry))
            continue
        with contextlib.suppress(KeyError):
            uids.add(pwd.getpwnam(entry).pw_uid)
    return uids


def check_owner(st, what: str, trusted=None, *, group_may_write=False) -> None:
    """Refuse a file a stranger owns or others may write (an impostor or a rewritten one).

    ``group_may_write`` is for the server's socket: connecting to a unix socket needs write
    permission, so a ``--group`` server's socket is 0660 by design; writing to it is only
    connecting, and the peer's credentials are checked after that."""
    trusted = trusted_uids() if trusted is None else trusted
    if st.st_uid not in trusted:
        raise QueueError(
            f"{what} is owned by uid {st.st_uid}, not a trusted server user "
            f"({sorted(trusted)}; add one with SHMINFER_SERVER_USERS): refused"
        )
    if stat.S_IMODE(st.st_mode) & (0o002 if group_may_write else 0o022):
        raise QueueError(
            f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}): refused"
        )


def read_registry(name: str, trusted=None) -> dict:
    check_unit_dir(name, trusted)
    path = registry_path(name)
    try:
        fd = _open_registry(path)
    except FileNotFoundError:
        raise QueueError(f"no shminfer server named {name!r} ({path} is missing)") from None
    except PermissionError:
        raise QueueError(not_in_group(path, _gid(path))) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise QueueError(f"{path} is a symlink: refused") from None
        raise QueueError(f"{path}: {exc.strerror}") from None
    st, raw = _read_registry_fd(fd, path)
    check_owner(st, path, trusted)
    try:
        data = json.loads(raw)
    except ValueError:
        raise QueueError(f"{path}: not a shminfer registry (bad JSON)") from None
    return _checked(name, data, path)


def _open_registry(path: str) -> int:
    """Never blocks (a FIFO planted as the registry), never follows a symlink."""
    return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)


def _read_registry_fd(fd: int, path: str):
    """(fstat, bytes) of an fd from _open_registry (closed here): a small regular file."""
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_REGISTRY:
            raise QueueError(f"{path} is not a shminfer registry (not a small regular file)")
        return st, handle.read(_MAX_REGISTRY + 1)


def _checked(name, data, path):
    """Only the names this server would use: a rewritten registry cannot point elsewhere."""
    try:
        workers = data["workers"]
        ok = isinstance(workers, list) and all(
            isinstance(w.get("cpu"), int) and w.get("segment") == segment_name(name, w["cpu"])
            for w in workers
        )
        ok = ok and data.get("socket", socket_name(name)) == socket_name(name)
    except (KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise QueueError(f"{path}: registry names files that are not this server's: refused")
    return data


def atomic_write(path: str, text: str, mode: int, gid: int | None = None) -> None:
    """Atomically (re)place path: a random O_EXCL|O_NOFOLLOW temp file beside it, renamed.

    A planted symlink at the temp name or at path is never followed (rename replaces the
    link itself); the file gets mode (and group gid) before it appears under its name.
    """
    while True:
        tmp = f"{path}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
            )
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            if gid is not None:
                os.fchown(handle.fileno(), -1, gid)
            os.fchmod(handle.fileno(), mode)
            handle.write(text)
        os.rename(tmp, path)  # replaces a planted symlink itself, never its target
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_registry(name: str, data: dict, mode: int, gid: int | None) -> None:
    """Atomically (re)place the registry (:func:`atomic_write`), never group-writable."""
    atomic_write(registry_path(name), json.dumps(data), mode & ~0o022, gid)


class NameLock:
    """One server per name: flock(LOCK_EX|LOCK_NB) on shminfer.NAME.lock, held for life.

    Non-blocking, so a peer holding a lock can never freeze anyone; the kernel drops it
    when the holder dies, so there is nothing stale to clean up.
    """

    def __init__(self, name: str):
        self.name = name
        self.path = path = lock_path(name)
        for _ in range(100):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                raise QueueError(f"{path}: cannot open the server lock ({exc.strerror})") from None
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise QueueError(
                    f"{path} belongs to uid {st.st_uid}, not this server's user: remove it"
                )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise QueueError(
                    f"a shminfer server named {name!r} is already running ({_running_pid(name)})"
                ) from None
            # The holder unlinks the lock file when it stops: ours counts only if the
            # path still names the file we locked (else a newer server owns a new one).
            try:
                now = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.fchmod(fd, 0o600)
                self.fd = fd
                return
            os.close(fd)
        raise QueueError(f"{path}: could not take the server lock (it keeps changing)")

    def release(self, unlink=True):
        if self.fd is not None:
            if unlink:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
            os.close(self.fd)
            self.fd = None


def _running_pid(name):
    path = registry_path(name)
    try:
        _st, raw = _read_registry_fd(_open_registry(path), path)
        return f"pid {int(json.loads(raw)['pid'])}"
    except (OSError, QueueError, ValueError, KeyError, TypeError):
        return "starting"


def remove_stale(name: str) -> list:
    """Remove what a crashed server of this name left in its directory. Call with its
    NameLock held: a live server cannot own them, as it would hold the lock. Only this
    user's files go (lstat, never following a link)."""
    removed = []
    owned = re.compile(
        r"^(%s|%s(\.[0-9a-f]{16}\.tmp)?)$" % (re.escape(SOCKET), re.escape(REGISTRY))
    )
    directory = unit_dir(name)
    for entry in os.listdir(directory):
        if not owned.match(entry):
            continue
        path = os.path.join(directory, entry)
        try:
            if os.lstat(path).st_uid != os.geteuid():
                continue
            os.unlink(path)
            removed.append(entry)
        except OSError:
            pass
    return removed


def alive(data: dict) -> bool:
    """Is the registry's server running? A pid that is not a positive integer (a registry
    written by hand or scribbled) names no process: False, never an exception."""
    pid = data.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    return _sys.alive(pid, data.get("pid_start", -1))
