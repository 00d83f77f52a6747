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

The code is split over rtfleet.lab_state (constants, locations, host records, inventory),
rtfleet.lab_topologies (topology files -> QEMU arguments) and rtfleet.lab_qemu (processes,
ports, keys, booting, power, the guest probe); this module holds the commands and re-exports
their names, so `rtfleet.lab.X` keeps working for every X the lab had.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rtfleet.lab_qemu import (
    HANG_CPU_SHARE,
    HANG_WINDOW_S,
    BootHang,
    _require_tool,
    compare_expect,
    ensure_key,
    free_port,
    host_alive,
    launch_qemu,
    pid_alive,
    port_is_free,
    power_off,
    probe_host,
    probe_script,
    process_cpu_seconds,
    qemu_argv,
    qemu_major,
    read_pid,
    remove_host,
    serial_tail,
    ssh_argv,
    ssh_ready,
    start_host,
    stop_process,
    summarise_topology,
    wait_for_ssh,
    warn_old_qemu,
)
from rtfleet.lab_state import (
    DEFAULT_BOOT_TIMEOUT_S,
    HOST_NAME_RE,
    IMAGE_PREFIX,
    LAB_USER,
    QEMU_BINARY,
    QEMU_INSTALL_HINT,
    QEMU_RELIABLE_CPUS,
    QEMU_RELIABLE_MAJOR,
    SERIAL_TAIL_LINES,
    SSH_COMMON_ARGS,
    SSH_OPTIONS,
    Host,
    LabError,
    build_inventory,
    cache_dir,
    find_repo_root,
    group_name,
    host_dir,
    image_hash,
    image_path,
    key_path,
    load_hosts,
    overlay_path,
    pidfile_path,
    record_path,
    save_host,
    serial_log_path,
    state_dir,
    state_lock,
    write_inventory,
)
from rtfleet.lab_topologies import (
    Topology,
    available_topologies,
    load_topology,
    topologies_dir,
    topology_argv,
    topology_from_dict,
)

__all__ = [
    "DEFAULT_BOOT_TIMEOUT_S",
    "HANG_CPU_SHARE",
    "HANG_WINDOW_S",
    "HOST_NAME_RE",
    "IMAGE_PREFIX",
    "LAB_USER",
    "QEMU_BINARY",
    "QEMU_INSTALL_HINT",
    "QEMU_RELIABLE_CPUS",
    "QEMU_RELIABLE_MAJOR",
    "SERIAL_TAIL_LINES",
    "SSH_COMMON_ARGS",
    "SSH_OPTIONS",
    "BootHang",
    "Host",
    "LabError",
    "Topology",
    "add_parser",
    "available_topologies",
    "build_inventory",
    "cache_dir",
    "cmd_down",
    "cmd_image",
    "cmd_power",
    "cmd_probe",
    "cmd_ssh",
    "cmd_status",
    "cmd_up",
    "compare_expect",
    "ensure_key",
    "find_repo_root",
    "free_port",
    "group_name",
    "host_alive",
    "host_dir",
    "host_status",
    "image_hash",
    "image_path",
    "key_path",
    "launch_qemu",
    "load_hosts",
    "load_topology",
    "overlay_path",
    "pid_alive",
    "pidfile_path",
    "port_is_free",
    "power_off",
    "probe_host",
    "probe_script",
    "process_cpu_seconds",
    "qemu_argv",
    "qemu_major",
    "read_pid",
    "record_path",
    "remove_host",
    "save_host",
    "serial_log_path",
    "serial_tail",
    "ssh_argv",
    "ssh_ready",
    "start_host",
    "state_dir",
    "state_lock",
    "stop_process",
    "summarise_topology",
    "topologies_dir",
    "topology_argv",
    "topology_from_dict",
    "wait_for_ssh",
    "warn_old_qemu",
    "write_inventory",
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


def _up_image(args: argparse.Namespace, repo: Path, topologies: dict[str, Topology]) -> Path:
    """Check the tools `up` needs, warn about an old QEMU; the base image to boot from."""
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
    return image


def _start_hosts(
    args: argparse.Namespace,
    state: Path,
    specs: list[tuple[str, str]],
    *,
    topologies: dict[str, Topology],
    image: Path,
    key: Path,
    failures: list[str],
) -> list[Host]:
    """Start QEMU for each host not up yet (under the state lock) -> the hosts booting."""
    pending: list[Host] = []
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
    return pending


def _boot_host(
    state: Path,
    host: Host,
    topo: Topology,
    *,
    image: Path,
    key: Path,
    timeout: float,
    failures: list[str],
) -> None:
    """Wait for a started host's ssh (one more boot after a hang); record or remove it."""
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
            start_host(state, host, topo, image, key)
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


def cmd_up(args: argparse.Namespace) -> int:
    repo = find_repo_root()
    state = state_dir(repo)
    specs = _host_specs(args)
    topologies = {topology: load_topology(repo, topology) for _, topology in specs}
    image = _up_image(args, repo, topologies)
    key = ensure_key(state)

    failures: list[str] = []
    with state_lock(state):
        pending = _start_hosts(
            args, state, specs, topologies=topologies, image=image, key=key, failures=failures
        )
        write_inventory(state)

    timeout = args.timeout or DEFAULT_BOOT_TIMEOUT_S * max(1, len(pending))

    def boot(host: Host) -> None:
        _boot_host(
            state,
            host,
            topologies[host.topology],
            image=image,
            key=key,
            timeout=timeout,
            failures=failures,
        )

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
