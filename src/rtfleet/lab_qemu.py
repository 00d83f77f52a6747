"""Lab guests: QEMU processes (pidfiles), ports, ssh keys, booting, power and the guest probe.

Processes are found through their pidfile and checked against /proc/<pid>/cmdline (the
overlay path must appear) before any signal (see rtfleet.lab).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from rtfleet import topology
from rtfleet.cpulist import format_cpulist
from rtfleet.lab_state import (
    LAB_USER,
    QEMU_BINARY,
    QEMU_RELIABLE_CPUS,
    QEMU_RELIABLE_MAJOR,
    SERIAL_TAIL_LINES,
    SSH_OPTIONS,
    Host,
    LabError,
    host_dir,
    key_path,
    load_hosts,
    overlay_path,
    pidfile_path,
    save_host,
    serial_log_path,
)
from rtfleet.lab_topologies import Topology, _qemu_opt, topology_argv

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
