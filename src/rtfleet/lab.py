"""Disposable QEMU lab hosts: `rtfleet lab image|up|down|status|ssh`.

Each host is a qcow2 overlay on one cached Debian 12 base image (lab/build-image.sh), booted
under QEMU with a CPU/NUMA topology from lab/topologies/<name>.yml. Everything a host owns
lives in `<state>/hosts/<name>/` (overlay, pidfile, serial log, host.json), and
`<state>/inventory.yml` is regenerated from those records after every change, so Ansible,
Molecule and people see the same hosts.

Design notes:
* Processes are found through their pidfile and checked against /proc/<pid>/cmdline (the
  overlay path must appear) before any signal: never by name, never a recycled pid.
* The ssh key is generated per state dir and handed to each guest through QEMU fw_cfg;
  the image bakes no key, so one image serves every checkout.
* Everything listens on 127.0.0.1 only (hostfwd bound to loopback).
* Stdlib + PyYAML only: the lab must work before anything else in the project does.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from rtfleet import topology
from rtfleet.cpulist import format_cpulist, parse_cpulist

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


# --------------------------------------------------------------------------- topologies


def _runs(cpus: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], cpu)
        else:
            runs.append((cpu, cpu))
    return runs


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str
    description: str
    cpu_model: str
    cpu_flags: tuple[str, ...]
    sockets: int
    dies: int
    cores: int
    threads: int
    memory_mib: int
    numa: tuple[tuple[tuple[int, ...], int], ...]  # (cpus, memory_mib) per node
    smbios: tuple[dict[str, Any], ...]
    expect: dict[str, Any]

    @property
    def cpus(self) -> int:
        return self.sockets * self.dies * self.cores * self.threads


def topologies_dir(repo_root: Path) -> Path:
    return repo_root / "lab" / "topologies"


def available_topologies(repo_root: Path) -> list[str]:
    return sorted(p.stem for p in topologies_dir(repo_root).glob("*.yml"))


def load_topology(repo_root: Path, name: str) -> Topology:
    path = topologies_dir(repo_root) / f"{name}.yml"
    if not path.is_file():
        known = ", ".join(available_topologies(repo_root))
        raise LabError(f"unknown topology {name!r}; known: {known}")
    with open(path) as stream:
        data = yaml.safe_load(stream)
    return topology_from_dict(data, source=str(path))


def topology_from_dict(data: dict[str, Any], source: str = "<topology>") -> Topology:
    """Validate a topology document; errors name the file and the key."""

    def need(key: str, kind: type) -> Any:
        value = data.get(key)
        if not isinstance(value, kind):
            raise LabError(f"{source}: {key!r} must be a {kind.__name__}")
        return value

    cpu = need("cpu", dict)
    smp = need("smp", dict)
    sockets, dies, cores, threads = (
        int(smp.get(k, 1)) for k in ("sockets", "dies", "cores", "threads")
    )
    memory_mib = int(need("memory_mib", int))
    ncpus = sockets * dies * cores * threads
    nodes = []
    seen: set[int] = set()
    for index, node in enumerate(data.get("numa") or []):
        cpus = tuple(parse_cpulist(str(node["cpus"])))
        if seen & set(cpus) or (cpus and cpus[-1] >= ncpus):
            raise LabError(
                f"{source}: numa[{index}].cpus {node['cpus']!r} overlaps or exceeds {ncpus} cpus"
            )
        seen.update(cpus)
        nodes.append((cpus, int(node["memory_mib"])))
    if nodes and seen != set(range(ncpus)):
        raise LabError(f"{source}: numa nodes must cover cpus 0-{ncpus - 1} exactly")
    if nodes and sum(mem for _, mem in nodes) != memory_mib:
        raise LabError(f"{source}: numa memory_mib must add up to memory_mib ({memory_mib})")
    cpu_flags = tuple(str(f) for f in cpu.get("flags") or [])
    if (
        dies > 1
        and "vendor=GenuineIntel" in cpu_flags
        and ("full-cpuid-auto-level=off" not in cpu_flags)
    ):
        # QEMU 10 exposes CPUID leaf 0x1f for this and aborts as the guest boots.
        raise LabError(
            f"{source}: an Intel vendor with dies > 1 needs 'full-cpuid-auto-level=off' in "
            "cpu.flags (QEMU 10 aborts on CPUID leaf 0x1f otherwise; see lab/README.md)"
        )
    smbios = tuple(dict(entry) for entry in data.get("smbios") or [])
    for entry in smbios:
        if "type" not in entry:
            raise LabError(f"{source}: every smbios entry needs a type")
    return Topology(
        name=need("name", str),
        description=str(data.get("description", "")).strip(),
        cpu_model=str(cpu["model"]),
        cpu_flags=cpu_flags,
        sockets=sockets,
        dies=dies,
        cores=cores,
        threads=threads,
        memory_mib=memory_mib,
        numa=tuple(nodes),
        smbios=smbios,
        expect=dict(data.get("expect") or {}),
    )


def _qemu_opt(value: object) -> str:
    # QEMU option values escape a literal comma by doubling it.
    return str(value).replace(",", ",,")


def topology_argv(topo: Topology) -> list[str]:
    """The QEMU arguments that give a guest this topology."""
    argv = ["-cpu", ",".join([topo.cpu_model, *topo.cpu_flags])]
    smp = (
        f"{topo.cpus},sockets={topo.sockets},dies={topo.dies},"
        f"cores={topo.cores},threads={topo.threads}"
    )
    argv += ["-smp", smp, "-m", f"{topo.memory_mib}M"]
    for nodeid, (cpus, memory_mib) in enumerate(topo.numa):
        argv += ["-object", f"memory-backend-ram,id=m{nodeid},size={memory_mib}M"]
        cpu_opts = ",".join(
            f"cpus={lo}" if lo == hi else f"cpus={lo}-{hi}" for lo, hi in _runs(list(cpus))
        )
        argv += ["-numa", f"node,nodeid={nodeid},{cpu_opts},memdev=m{nodeid}"]
    for entry in topo.smbios:
        fields = [f"type={entry['type']}"]
        fields += [f"{key}={_qemu_opt(value)}" for key, value in entry.items() if key != "type"]
        argv += ["-smbios", ",".join(fields)]
    return argv


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


# --------------------------------------------------------------------------- processes


def read_pid(pidfile: Path) -> int | None:
    try:
        text = pidfile.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def pid_alive(pid: int, marker: str | None = None) -> bool:
    """True when pid runs (not a zombie) and, given a marker, its argv contains it.

    The marker (the host's overlay path) guards against a recycled pid from a stale pidfile.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    proc = Path(f"/proc/{pid}")
    try:
        stat = (proc / "stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return False
        cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return marker is None or marker in cmdline


def stop_process(pidfile: Path, marker: str | None, timeout: float = 15.0) -> bool:
    """SIGTERM, wait, SIGKILL the process a pidfile names; remove the pidfile.

    Returns True when a live process was stopped, False for a missing or stale pidfile.
    """
    pid = read_pid(pidfile)
    stopped = False
    if pid is not None and pid_alive(pid, marker):
        for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            if _wait_gone(pid, marker, wait_s):
                stopped = True
                break
        else:
            raise LabError(f"process {pid} from {pidfile} survived SIGKILL")
    with contextlib.suppress(FileNotFoundError):
        pidfile.unlink()
    return stopped


def _wait_gone(pid: int, marker: str | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid, marker):
            return True
        _reap(pid)
        time.sleep(0.1)
    return not pid_alive(pid, marker)


def _reap(pid: int) -> None:
    # Only our own children can be reaped (tests run `sleep` as one); QEMU daemonises.
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def host_alive(state: Path, name: str) -> tuple[int | None, bool]:
    pid = read_pid(pidfile_path(state, name))
    return pid, pid is not None and pid_alive(pid, str(overlay_path(state, name)))


# --------------------------------------------------------------------------- ports and keys


def free_port(exclude: set[int] | frozenset[int] = frozenset(), attempts: int = 50) -> int:
    """A loopback TCP port nobody listens on now (the kernel picks; bind-tested)."""
    for _ in range(attempts):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in exclude and port_is_free(port):
            return port
    raise LabError("no free loopback port found")


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ensure_key(state: Path) -> Path:
    key = key_path(state)
    if key.is_file() and key.with_suffix(".pub").is_file():
        key.chmod(0o600)
        return key
    _require_tool("ssh-keygen", "apt-get install openssh-client")
    key.parent.mkdir(parents=True, exist_ok=True)
    key.parent.chmod(0o700)
    for stale in (key, key.with_suffix(".pub")):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "rtfleet-lab", "-f", str(key)],
        check=True,
    )
    key.chmod(0o600)
    return key


def qemu_major(version_text: str) -> int | None:
    """The major version in ``qemu-system-x86_64 --version`` output, None when unreadable."""
    match = re.match(r"QEMU emulator version (\d+)\.", version_text)
    return int(match.group(1)) if match else None


def warn_old_qemu(topologies: dict[str, Topology]) -> str | None:
    """A one-line warning when a guest this large runs on a QEMU known to hang its RT boots."""
    large = sorted(name for name, topo in topologies.items() if topo.cpus > QEMU_RELIABLE_CPUS)
    if not large:
        return None
    result = subprocess.run([QEMU_BINARY, "--version"], capture_output=True, text=True, check=False)
    major = qemu_major(result.stdout)
    if major is not None and major >= QEMU_RELIABLE_MAJOR:
        return None
    return (
        f"warning: {', '.join(large)}: QEMU {major if major is not None else '(unknown)'} "
        f"can hang a guest of more than {QEMU_RELIABLE_CPUS} vCPUs booting PREEMPT_RT; "
        f"lab/install-deps.sh installs QEMU {QEMU_RELIABLE_MAJOR} (docs/dev/runs.md)"
    )


def _require_tool(tool: str, hint: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise LabError(f"{tool} not found; install it with: {hint}")
    return path


# --------------------------------------------------------------------------- QEMU


def qemu_argv(
    state: Path,
    host: Host,
    topo: Topology,
    key: Path,
    accel: str = "tcg",
) -> list[str]:
    """The full QEMU command line for one lab host (daemonised, pidfile, loopback ssh)."""
    accel_opt = "tcg,thread=multi" if accel == "tcg" else accel
    overlay = overlay_path(state, host.name)
    return [
        QEMU_BINARY,
        "-name", f"rtfleet-lab-{host.name}",
        "-machine", "q35",
        "-accel", accel_opt,
        *topology_argv(topo),
        "-drive",
        f"file={_qemu_opt(overlay)},format=qcow2,if=virtio,cache={host.disk_cache},discard=unmap",
        "-nic", f"user,model=virtio-net-pci,hostfwd=tcp:127.0.0.1:{host.port}-:22",
        "-fw_cfg", f"name=opt/rtfleet/authorized_keys,file={_qemu_opt(key.with_suffix('.pub'))}",
        "-fw_cfg", f"name=opt/rtfleet/hostname,string={host.name}",
        "-serial", f"file:{serial_log_path(state, host.name)}",
        "-display", "none",
        "-monitor", "none",
        "-pidfile", str(pidfile_path(state, host.name)),
        "-daemonize",
    ]  # fmt: skip


def serial_tail(state: Path, name: str, lines: int = SERIAL_TAIL_LINES) -> str:
    try:
        text = serial_log_path(state, name).read_text(errors="replace")
    except OSError:
        return "(no serial log)"
    # The serial console carries ANSI colour codes and CRs from systemd.
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r", "")
    return "\n".join(text.splitlines()[-lines:])


def ssh_argv(
    state: Path, host: Host, command: list[str] | None = None, connect_timeout: int = 10
) -> list[str]:
    argv = [
        "ssh", *SSH_OPTIONS,
        "-o", f"ConnectTimeout={connect_timeout}",
        "-i", str(key_path(state)),
        "-p", str(host.port),
        f"{LAB_USER}@127.0.0.1",
    ]  # fmt: skip
    if command:
        argv += ["--", *command]
    return argv


def ssh_ready(state: Path, host: Host) -> bool:
    try:
        result = subprocess.run(
            ssh_argv(state, host, ["true"], connect_timeout=5),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=30,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return False
    return result.returncode == 0


def start_host(state: Path, host: Host, topo: Topology, image: Path, key: Path) -> None:
    """Create the overlay and start QEMU; retries with a new port if the port was taken."""
    hdir = host_dir(state, host.name)
    hdir.mkdir(parents=True, exist_ok=True)
    overlay = overlay_path(state, host.name)
    with contextlib.suppress(FileNotFoundError):
        overlay.unlink()
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(image), str(overlay)],
        check=True,
    )
    launch_qemu(state, host, topo, key)


def launch_qemu(state: Path, host: Host, topo: Topology, key: Path) -> None:
    """Start QEMU on the host's existing overlay (a power-on)."""
    hdir = host_dir(state, host.name)
    used = {h.port for h in load_hosts(state).values() if h.name != host.name}
    for attempt in range(3):
        if attempt or not port_is_free(host.port) or host.port in used:
            host.port = free_port(exclude=used)
        argv = qemu_argv(state, host, topo, key, accel=host.accel)
        result = subprocess.run(argv, capture_output=True, text=True, check=False)
        if result.returncode == 0:
            host.started_at = time.time()
            save_host(state, host)
            (hdir / "qemu.argv").write_text(shlex.join(argv) + "\n")
            return
        if "host forwarding" not in result.stderr:
            break
    raise LabError(f"{host.name}: QEMU failed to start:\n{result.stderr.strip()}")


# A booting TCG guest keeps its QEMU busy; one that hung in early boot (seen: an RCU stall
# with "timer wakeup didn't happen" while the controller was loaded, then nothing) leaves
# it idle. Below this share of one host CPU over HANG_WINDOW_S without ssh, it is hung.
HANG_WINDOW_S = 90.0
HANG_CPU_SHARE = 0.02


class BootHang(LabError):
    """The guest stopped booting: its QEMU sat idle without ssh (worth one more boot)."""


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of pid (/proc/PID/stat), None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for_ssh(state: Path, host: Host, timeout: float, hang_window_s=HANG_WINDOW_S) -> float:
    """Seconds until ssh answered; on timeout, a dead QEMU or a hung guest (:class:`BootHang`)
    stop it and raise with the serial log's end."""
    start = time.monotonic()
    marker = str(overlay_path(state, host.name))
    samples: list[tuple[float, float]] = []  # (monotonic, QEMU CPU seconds)
    error = LabError
    while True:
        pid = read_pid(pidfile_path(state, host.name))
        if pid is None or not pid_alive(pid, marker):
            reason = "QEMU exited while booting"
            break
        if ssh_ready(state, host):
            return time.monotonic() - start
        now = time.monotonic()
        if now - start > timeout:
            reason = f"no ssh after {timeout:.0f} s"
            break
        cpu = process_cpu_seconds(pid)
        if cpu is not None:
            samples.append((now, cpu))
            while len(samples) > 1 and now - samples[1][0] >= hang_window_s:
                samples.pop(0)
            since, used = now - samples[0][0], cpu - samples[0][1]
            if since >= hang_window_s and used < HANG_CPU_SHARE * since:
                reason = f"hung: QEMU used {used:.1f} s of CPU in {since:.0f} s, no ssh"
                error = BootHang
                break
        time.sleep(3)
    stop_process(pidfile_path(state, host.name), marker)
    tail = serial_tail(state, host.name)
    raise error(f"{host.name}: {reason}; stopped its QEMU. The serial log ends with:\n{tail}")


def remove_host(state: Path, name: str) -> bool:
    """Stop a host's QEMU (pidfile), drop its overlay and record; keep the serial log."""
    hdir = host_dir(state, name)
    stopped = stop_process(pidfile_path(state, name), str(overlay_path(state, name)))
    serial = serial_log_path(state, name)
    if serial.exists():
        logs = state / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        serial.replace(logs / f"{name}.serial.log")
    shutil.rmtree(hdir, ignore_errors=True)
    return stopped


# --------------------------------------------------------------------------- guest probe

# The guest is read by rtfleet's one topology reader (sysfs, never lscpu, which misreports
# these guests' sockets and caches): its source is piped to the guest's python3, its
# modules (topology.py and the two under it) made into one package in memory there.
_PROBE_MODULES = ("cpulist", "hostfacts", "topology")
_PROBE_FOOTER = """
import json as _json, subprocess as _sp
_virt = _sp.run(["systemd-detect-virt"], capture_output=True, text=True).stdout.strip()
print(_json.dumps({"topology": read_topology("/"), "virt": _virt}))
"""


def summarise_topology(topo: dict[str, Any], virt: str = "") -> dict[str, Any]:
    """A topology in the vocabulary of a lab topology's `expect` block."""
    return {
        "cpus": len(topo["cpus"]),
        "packages": len(topo["packages"]),
        "dies": len(topo["dies"]) or len(topo["packages"]),
        "threads_per_core": topo["smt"]["threads_per_core"],
        "numa_nodes": [format_cpulist(n["cpus"]) for n in topo["numa_nodes"]],
        "l3_groups": [format_cpulist(g["cpus"]) for g in topo["l3_groups"]],
        "virtualization": virt,
        "kernel": topo["kernel"]["release"],
        "cmdline": topo["kernel"]["cmdline"],
    }


def probe_script(footer: str = _PROBE_FOOTER) -> str:
    """A python3 script for stdin: the topology reader's modules, then ``footer``, which
    calls ``read_topology``; the guest needs nothing of rtfleet installed."""
    here = Path(topology.__file__).parent
    lines = [
        "import sys as _sys, types as _types",
        "_sys.modules['rtfleet_probe'] = _types.ModuleType('rtfleet_probe')",
        "_sys.modules['rtfleet_probe'].__path__ = []",
    ]
    for name in _PROBE_MODULES:
        source = (here / f"{name}.py").read_text(encoding="utf-8")
        qualified = f"rtfleet_probe.{name}"
        lines += [
            f"_mod = _sys.modules[{qualified!r}] = _types.ModuleType({qualified!r})",
            "_mod.__package__ = 'rtfleet_probe'",
            f"exec(compile({source!r}, '{name}.py', 'exec'), _mod.__dict__)",
        ]
    lines.append("read_topology = _sys.modules['rtfleet_probe.topology'].read_topology")
    return "\n".join(lines) + "\n" + footer


def probe_host(state: Path, host: Host) -> dict[str, Any]:
    script = probe_script()
    result = subprocess.run(
        ssh_argv(state, host, ["python3", "-"]),
        input=script,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        raise LabError(f"{host.name}: probe failed: {result.stderr.strip()}")
    data = json.loads(result.stdout.strip().splitlines()[-1])
    return summarise_topology(data["topology"], data["virt"])


def compare_expect(expect: dict[str, Any], seen: dict[str, Any]) -> list[str]:
    """Differences between a topology's `expect` block and what the guest showed."""
    return [
        f"{key}: expected {value!r}, guest shows {seen.get(key)!r}"
        for key, value in expect.items()
        if seen.get(key) != value
    ]


# --------------------------------------------------------------------------- commands


def _host_specs(args: argparse.Namespace) -> list[tuple[str, str]]:
    specs: list[tuple[str, str]] = []
    for spec in args.hosts:
        name, sep, topology = spec.partition("=")
        if not sep or not name or not topology:
            raise LabError(f"expected HOST=TOPOLOGY, got {spec!r}")
        specs.append((name, topology))
    if args.topology:
        specs.append((args.name or args.topology, args.topology))
    elif args.name:
        raise LabError("--name needs --topology")
    if not specs:
        raise LabError("nothing to bring up: give HOST=TOPOLOGY ... or --topology T [--name N]")
    names = [name for name, _ in specs]
    for name in names:
        if not HOST_NAME_RE.match(name):
            raise LabError(
                f"host name {name!r}: use lowercase letters, digits and dashes (a hostname)"
            )
    if len(set(names)) != len(names):
        raise LabError("host names must be unique")
    return specs


def cmd_image(args: argparse.Namespace) -> int:
    repo = find_repo_root()
    image = image_path(repo)
    if image.exists() and not args.force:
        print(image)
        return 0
    argv = [str(repo / "lab" / "build-image.sh")]
    if args.force:
        argv.append("--force")
    result = subprocess.run(argv, check=False)
    return result.returncode


def cmd_up(args: argparse.Namespace) -> int:
    repo = find_repo_root()
    state = state_dir(repo)
    specs = _host_specs(args)
    topologies = {topology: load_topology(repo, topology) for _, topology in specs}
    _require_tool(QEMU_BINARY, QEMU_INSTALL_HINT)
    _require_tool("qemu-img", QEMU_INSTALL_HINT)
    _require_tool("ssh", "apt-get install openssh-client")
    warning = warn_old_qemu(topologies)
    if warning:
        print(warning, file=sys.stderr)
    image = Path(args.image).resolve() if args.image else image_path(repo)
    if not image.is_file():
        raise LabError(
            f"base image {image} not found; build it with `rtfleet lab image` "
            "(lab/build-image.sh, about 5 minutes, needs root)"
        )
    key = ensure_key(state)

    pending: list[Host] = []
    failures: list[str] = []
    with state_lock(state):
        existing = load_hosts(state)
        running = {name for name in existing if host_alive(state, name)[1]}
        for name, topology in specs:
            if name in running and existing[name].topology != topology:
                raise LabError(
                    f"{name} is up as {existing[name].topology}; `rtfleet lab down {name}` first"
                )
        for name, topology in specs:
            if name in running:
                print(f"{name}: already up ({topology}, port {existing[name].port})")
                continue
            if host_dir(state, name).exists():
                remove_host(state, name)  # stale: dead QEMU or a half-made host
            host = Host(
                name=name,
                topology=topology,
                port=0,
                accel=args.accel,
                image=str(image),
                disk_cache=args.disk_cache,
            )
            host.port = free_port(
                exclude={h.port for h in existing.values()} | {h.port for h in pending}
            )
            try:
                start_host(state, host, topologies[topology], image, key)
            except (LabError, subprocess.CalledProcessError) as exc:
                failures.append(f"{name}: {exc}")
                remove_host(state, name)
                continue
            print(
                f"{name}: booting {topology} on 127.0.0.1:{host.port} "
                f"(serial log {serial_log_path(state, name)})"
            )
            pending.append(host)
        write_inventory(state)

    def boot(host: Host) -> None:
        try:
            try:
                seconds = wait_for_ssh(state, host, timeout)
            except BootHang as exc:
                # Once more from a fresh overlay: a hang is the emulator's, not the image's.
                print(f"{exc}\n{host.name}: booting it once more", file=sys.stderr)
                logs = state / "logs"
                logs.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(OSError):
                    shutil.copy(
                        serial_log_path(state, host.name), logs / f"{host.name}.hung.serial.log"
                    )
                start_host(state, host, topologies[host.topology], image, key)
                seconds = wait_for_ssh(state, host, timeout)
        except (LabError, subprocess.CalledProcessError) as exc:
            with state_lock(state):
                # Keep the serial log for the post-mortem; drop the rest of the host.
                remove_host(state, host.name)
            log = state / "logs" / f"{host.name}.serial.log"
            failures.append(f"{exc}\n(full serial log: {log})")
            return
        host.boot_seconds = round(seconds, 1)
        with state_lock(state):
            save_host(state, host)
        print(f"{host.name}: ssh ready after {seconds:.0f} s")

    timeout = args.timeout or DEFAULT_BOOT_TIMEOUT_S * max(1, len(pending))
    if pending:
        with ThreadPoolExecutor(max_workers=len(pending)) as pool:
            list(pool.map(boot, pending))
    with state_lock(state):
        inventory = write_inventory(state)
    print(f"inventory: {inventory}")
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    return 1 if failures else 0


def cmd_down(args: argparse.Namespace) -> int:
    state = state_dir()
    if not args.all and not args.hosts:
        raise LabError("name the hosts to stop, or pass --all")
    with state_lock(state):
        if args.all:
            names = sorted(p.name for p in (state / "hosts").glob("*") if p.is_dir())
        else:
            names = args.hosts
            unknown = [n for n in names if not host_dir(state, n).exists()]
            for name in unknown:
                print(f"{name}: not in {state} (already down)")
            names = [n for n in names if n not in unknown]
        for name in names:
            stopped = remove_host(state, name)
            print(f"{name}: {'stopped and removed' if stopped else 'removed (was not running)'}")
        write_inventory(state)
    return 0


def host_status(state: Path) -> list[dict[str, Any]]:
    rows = []
    for name, host in load_hosts(state).items():
        pid, alive = host_alive(state, name)
        rows.append(
            {
                "host": name,
                "topology": host.topology,
                "port": host.port,
                "pid": pid,
                "alive": alive,
                "boot_seconds": host.boot_seconds,
                "serial_log": str(serial_log_path(state, name)),
            }
        )
    return rows


def cmd_status(args: argparse.Namespace) -> int:
    state = state_dir()
    rows = host_status(state)
    if args.format == "json":
        print(json.dumps({"state_dir": str(state), "hosts": rows}, indent=2))
        return 0
    columns = ["host", "topology", "port", "pid", "alive"]
    table = [columns] + [
        [str(row[c]) if row[c] is not None else "-" for c in columns] for row in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    if not rows:
        print(f"(no lab hosts in {state})")
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    repo = find_repo_root()
    state = state_dir(repo)
    hosts = load_hosts(state)
    names = args.hosts or sorted(hosts)
    results: dict[str, Any] = {}
    mismatches = 0
    for name in names:
        host = hosts.get(name)
        if host is None:
            raise LabError(f"no lab host {name!r} in {state}; see `rtfleet lab status`")
        seen = probe_host(state, host)
        diff = compare_expect(load_topology(repo, host.topology).expect, seen)
        mismatches += bool(diff)
        results[name] = {"topology": host.topology, "seen": seen, "mismatches": diff}
    print(json.dumps(results, indent=2))
    return 1 if mismatches else 0


def power_off(state: Path, name: str) -> int:
    """Cut a host's power: SIGKILL to its QEMU, no shutdown, no flush. -> the pid killed.
    The overlay stays (`power on` boots it again); a host that is not running is an error,
    so a fault drill cannot pass without its fault."""
    pid, alive = host_alive(state, name)
    if pid is None or not alive:
        raise LabError(f"{name} is not running: there is no power to cut")
    os.kill(pid, signal.SIGKILL)
    if not _wait_gone(pid, str(overlay_path(state, name)), 10.0):
        raise LabError(f"{name}: QEMU {pid} survived SIGKILL")
    with contextlib.suppress(FileNotFoundError):
        pidfile_path(state, name).unlink()
    return pid


def cmd_power(args: argparse.Namespace) -> int:
    repo = find_repo_root()
    state = state_dir(repo)
    host = load_hosts(state).get(args.host)
    if host is None:
        raise LabError(f"no lab host {args.host!r} in {state}; see `rtfleet lab status`")
    if args.action == "off":
        with state_lock(state):
            pid = power_off(state, host.name)
        print(f"{host.name}: power cut (QEMU {pid} killed); `rtfleet lab power {host.name} on`")
        return 0
    if host_alive(state, host.name)[1]:
        raise LabError(f"{host.name} is running; cut its power first")
    with state_lock(state):
        launch_qemu(state, host, load_topology(repo, host.topology), key_path(state))
        write_inventory(state)
    seconds = wait_for_ssh(state, host, args.timeout or DEFAULT_BOOT_TIMEOUT_S)
    host.boot_seconds = round(seconds, 1)
    with state_lock(state):
        save_host(state, host)
    print(f"{host.name}: powered on, ssh ready after {seconds:.0f} s (port {host.port})")
    return 0


def cmd_ssh(args: argparse.Namespace) -> int:
    state = state_dir()
    host = load_hosts(state).get(args.host)
    if host is None:
        raise LabError(f"no lab host {args.host!r} in {state}; see `rtfleet lab status`")
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    argv = ssh_argv(state, host, command or None)
    os.execvp(argv[0], argv)
    return 0  # not reached


def _env_float(name: str) -> float | None:
    value = os.environ.get(name)
    return float(value) if value else None


def _run(func):
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except LabError as exc:
            print(f"rtfleet lab: error: {exc}", file=sys.stderr)
            return 1

    return wrapper


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "lab",
        help="bring disposable QEMU test hosts up and down",
        description=(
            "Disposable QEMU hosts with emulated CPU topologies (lab/topologies/*.yml). "
            "State: $RTFLEET_LAB_DIR or lab/.state; "
            "image cache: $RTFLEET_CACHE_DIR or ~/.cache/rtfleet."
        ),
    )
    parser.set_defaults(func=lambda args: parser.print_help() or 2)
    lab_sub = parser.add_subparsers(dest="lab_command", metavar="LAB_COMMAND")

    image = lab_sub.add_parser("image", help="build (or locate) the cached base image")
    image.add_argument("--force", action="store_true", help="rebuild even if the image exists")
    image.set_defaults(func=_run(cmd_image))

    up = lab_sub.add_parser("up", help="boot hosts (in parallel) and wait for ssh")
    up.add_argument("hosts", nargs="*", metavar="HOST=TOPOLOGY")
    up.add_argument("--topology", "-t", help="topology for one host (see lab/topologies/)")
    up.add_argument("--name", "-n", help="host name with --topology (default: the topology name)")
    up.add_argument(
        "--timeout",
        type=float,
        default=_env_float("RTFLEET_LAB_BOOT_TIMEOUT"),
        help=(
            f"seconds to wait for ssh ($RTFLEET_LAB_BOOT_TIMEOUT; default {DEFAULT_BOOT_TIMEOUT_S} "
            "times the number of hosts booting at once, since TCG guests share the host CPUs)"
        ),
    )
    up.add_argument(
        "--accel",
        choices=["tcg", "kvm"],
        default=os.environ.get("RTFLEET_LAB_ACCEL", "tcg"),
        help="QEMU accelerator (default %(default)s; stock Debian kernels fail under this KVM)",
    )
    up.add_argument("--image", help="base image to use instead of the cached one")
    up.add_argument(
        "--disk-cache",
        choices=["unsafe", "writeback"],
        default="unsafe",
        help="QEMU cache mode of the overlay: writeback honours the guest's flushes (fault drills)",
    )
    up.set_defaults(func=_run(cmd_up))

    down = lab_sub.add_parser("down", help="stop hosts and delete their overlays")
    down.add_argument("hosts", nargs="*", metavar="HOST")
    down.add_argument("--all", action="store_true", help="every host in the state dir")
    down.set_defaults(func=_run(cmd_down))

    status = lab_sub.add_parser("status", help="list hosts: topology, port, pid, alive")
    status.add_argument("--format", choices=["table", "json"], default="table")
    status.set_defaults(func=_run(cmd_status))

    probe = lab_sub.add_parser(
        "probe", help="read each host's CPU/cache/NUMA layout from sysfs; compare with `expect`"
    )
    probe.add_argument("hosts", nargs="*", metavar="HOST")
    probe.set_defaults(func=_run(cmd_probe))

    power = lab_sub.add_parser(
        "power", help="cut a host's power (SIGKILL to QEMU, overlay kept) or power it on again"
    )
    power.add_argument("host")
    power.add_argument("action", choices=["off", "on"])
    power.add_argument("--timeout", type=float, default=_env_float("RTFLEET_LAB_BOOT_TIMEOUT"))
    power.set_defaults(func=_run(cmd_power))

    ssh = lab_sub.add_parser("ssh", help="ssh into a host: rtfleet lab ssh HOST [-- CMD ...]")
    ssh.add_argument("host")
    ssh.add_argument("command", nargs=argparse.REMAINDER)
    ssh.set_defaults(func=_run(cmd_ssh))
