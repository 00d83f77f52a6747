"""The server registry: /dev/shm/shminfer.NAME.json says which segments a server owns."""

from __future__ import annotations

import json
import os
import re

from shminfer import _sys
from shminfer.queue import SHM_DIR, QueueError

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise QueueError(
            f"server name {name!r} must be 1-64 letters, digits, '_' or '-' "
            "(it names files in /dev/shm)"
        )
    return name


def registry_path(name: str) -> str:
    return os.path.join(SHM_DIR, f"shminfer.{check_name(name)}.json")


def segment_name(name: str, cpu: int) -> str:
    return f"shminfer.{check_name(name)}.cpu{cpu}"


def read_registry(name: str) -> dict:
    path = registry_path(name)
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise QueueError(f"no shminfer server named {name!r} ({path} is missing)") from None
    except PermissionError:
        raise QueueError(f"{path}: permission denied (not in the server's group?)") from None
    except ValueError:
        raise QueueError(f"{path}: not a shminfer registry (bad JSON)") from None


def write_registry(name: str, data: dict, mode: int, gid: int | None) -> None:
    path = registry_path(name)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        if gid is not None:
            os.fchown(handle.fileno(), -1, gid)
        os.fchmod(handle.fileno(), mode)
        json.dump(data, handle)
    os.replace(tmp, path)


def remove_stale(name: str) -> list[str]:
    """Remove what a crashed server left behind; refuse if that server still runs."""
    removed = []
    path = registry_path(name)
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        data = None
    except (ValueError, OSError):
        data = {}
    if data:
        pid, start = data.get("pid", 0), data.get("pid_start", -1)
        if _sys.alive(pid, start):
            raise QueueError(f"a shminfer server named {name!r} is already running (pid {pid})")
    owned = re.compile(r"^shminfer\.%s\.(cpu\d+|json|json\.tmp)$" % re.escape(name))
    for entry in os.listdir(SHM_DIR):
        if owned.match(entry):
            try:
                os.unlink(os.path.join(SHM_DIR, entry))
                removed.append(entry)
            except FileNotFoundError:
                pass
    return removed
