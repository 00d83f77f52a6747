"""The lab's constants, locations (state dir, image cache) and per-host state files.

See rtfleet.lab. A host's record, overlay, pidfile and serial log live in
`<state>/hosts/<name>/`; `<state>/inventory.yml` is regenerated from the records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import yaml

IMAGE_PREFIX = "debian12-rtfleet-"
LAB_USER = "lab"
DEFAULT_BOOT_TIMEOUT_S = 300
SERIAL_TAIL_LINES = 30
HOST_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
SSH_OPTIONS = (
    "-o", "BatchMode=yes",
    "-o", "StrictHostKeyChecking=no",
    "-o", "UserKnownHostsFile=/dev/null",
    "-o", "LogLevel=ERROR",
    "-o", "IdentitiesOnly=yes",
)  # fmt: skip
# ServerAlive*: a connection that was open across a guest reboot (slirp keeps it half-open)
# dies in a minute instead of hanging the reboot module forever.
SSH_COMMON_ARGS = (
    "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null"
    " -o ServerAliveInterval=10 -o ServerAliveCountMax=6"
)
QEMU_BINARY = "qemu-system-x86_64"
QEMU_INSTALL_HINT = "apt-get install qemu-system-x86 qemu-utils"
# QEMU 7.2's TCG, a thread per vCPU, hung 3 of 8 PREEMPT_RT boots of the 48-vCPU guest in a
# cross-modifying-code race (docs/dev/runs.md); QEMU 10 held. Smaller guests did not show it.
QEMU_RELIABLE_MAJOR = 10  # lab/install-deps.sh installs at least this (qemu_min_major)
QEMU_RELIABLE_CPUS = 8


class LabError(Exception):
    """A failure to report to the user as one message, without a traceback."""


# --------------------------------------------------------------------------- locations


def find_repo_root(start: Path | None = None) -> Path:
    """The checkout holding lab/topologies: from the cwd upwards, else from this package."""
    candidates = [start or Path.cwd()]
    candidates += list(candidates[0].resolve().parents)
    candidates.append(Path(__file__).resolve().parents[2])
    for path in candidates:
        if (path / "lab" / "topologies").is_dir():
            return path.resolve()
    raise LabError("cannot find the rtfleet checkout (a directory with lab/topologies/)")


def state_dir(repo_root: Path | None = None) -> Path:
    env = os.environ.get("RTFLEET_LAB_DIR")
    if env:
        return Path(env).expanduser().resolve()
    return (repo_root or find_repo_root()) / "lab" / ".state"


def cache_dir() -> Path:
    env = os.environ.get("RTFLEET_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rtfleet"


def image_hash(lab_dir: Path) -> str:
    """Hash of the image builder's inputs; mirrors image_hash() in lab/build-image.sh."""
    files = [lab_dir / "build-image.sh"]
    files += [p for p in (lab_dir / "image").rglob("*") if p.is_file()]
    rel = sorted(p.relative_to(lab_dir).as_posix() for p in files)
    digest = hashlib.sha256()
    for name in rel:
        digest.update(name.encode() + b"\0")
        digest.update((lab_dir / name).read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()[:12]


def image_path(repo_root: Path) -> Path:
    lab_dir = repo_root / "lab"
    return cache_dir() / "images" / f"{IMAGE_PREFIX}{image_hash(lab_dir)}.qcow2"


# --------------------------------------------------------------------------- hosts and state


@dataclasses.dataclass
class Host:
    name: str
    topology: str
    port: int
    accel: str = "tcg"
    image: str = ""
    boot_seconds: float | None = None
    started_at: float | None = None
    # QEMU's cache mode for the overlay. "unsafe" ignores the guest's flushes (fast, and a
    # stopped lab host is thrown away); the fault drills boot "writeback", where a flush
    # reaches the host, so a power cut (`rtfleet lab power HOST off`) loses only what the
    # guest had not flushed, as on a real disk.
    disk_cache: str = "unsafe"


def host_dir(state: Path, name: str) -> Path:
    return state / "hosts" / name


def overlay_path(state: Path, name: str) -> Path:
    return host_dir(state, name) / "overlay.qcow2"


def pidfile_path(state: Path, name: str) -> Path:
    return host_dir(state, name) / "qemu.pid"


def serial_log_path(state: Path, name: str) -> Path:
    return host_dir(state, name) / "serial.log"


def record_path(state: Path, name: str) -> Path:
    return host_dir(state, name) / "host.json"


def key_path(state: Path) -> Path:
    return state / "ssh" / "id_ed25519"


def load_hosts(state: Path) -> dict[str, Host]:
    hosts: dict[str, Host] = {}
    for record in sorted((state / "hosts").glob("*/host.json")):
        with contextlib.suppress(OSError, ValueError, TypeError):
            host = Host(**json.loads(record.read_text()))
            hosts[host.name] = host
    return hosts


def save_host(state: Path, host: Host) -> None:
    _write_atomic(
        record_path(state, host.name), json.dumps(dataclasses.asdict(host), indent=2) + "\n"
    )


def _write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.chmod(mode)
    tmp.replace(path)


@contextlib.contextmanager
def state_lock(state: Path):
    """Serialise changes to the state dir between concurrent `rtfleet lab` calls."""
    state.mkdir(parents=True, exist_ok=True)
    with open(state / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def group_name(topology: str) -> str:
    # Ansible group names must be identifiers; topology file names use dashes.
    return re.sub(r"[^A-Za-z0-9_]", "_", topology)


def build_inventory(hosts: dict[str, Host], key: Path) -> dict[str, Any]:
    lab_hosts: dict[str, Any] = {}
    groups: dict[str, Any] = {}
    for name in sorted(hosts):
        host = hosts[name]
        lab_hosts[name] = {
            "ansible_host": "127.0.0.1",
            "ansible_port": host.port,
            "ansible_user": LAB_USER,
            "ansible_ssh_private_key_file": str(key),
            # Overlays get fresh host keys and ports get reused: known_hosts would only hurt.
            "ansible_ssh_common_args": SSH_COMMON_ARGS,
            "ansible_python_interpreter": "/usr/bin/python3",
            "rtfleet_lab_topology": host.topology,
        }
        groups.setdefault(group_name(host.topology), {"hosts": {}})["hosts"][name] = None
    children: dict[str, Any] = {"lab": {"hosts": lab_hosts}}
    children.update(dict(sorted(groups.items())))
    return {"all": {"children": children}}


def write_inventory(state: Path) -> Path:
    path = state / "inventory.yml"
    inventory = build_inventory(load_hosts(state), key_path(state))
    header = (
        "---\n"
        "# Written by `rtfleet lab`; regenerated on every up/down, so edits here are lost.\n"
        "# Groups: `lab` (all hosts) and one per topology (dashes become underscores).\n"
    )
    _write_atomic(
        path, header + yaml.safe_dump(inventory, sort_keys=False, default_flow_style=False)
    )
    return path
