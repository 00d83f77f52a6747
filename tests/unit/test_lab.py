"""The lab tool without booting anything (plus one `vm` test that boots epyc-2ccx)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rtfleet import lab

REPO = Path(__file__).resolve().parents[2]
TOPOLOGY_NAMES = ["ccx-smt", "dual-socket", "epyc-2ccx", "epyc-4ccx", "server-nps2", "vmware-like"]


@pytest.fixture
def state(tmp_path, monkeypatch):
    state = tmp_path / "state"
    monkeypatch.setenv("RTFLEET_LAB_DIR", str(state))
    monkeypatch.setenv("RTFLEET_CACHE_DIR", str(tmp_path / "cache"))
    return state


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="rtfleet")
    lab.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return int(args.func(args) or 0)


def sleeper(*marker: str) -> subprocess.Popen:
    """A real process whose argv carries `marker`, standing in for QEMU.

    Returns once the child has exec'd: until then /proc/PID/cmdline is still pytest's.
    """
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *marker])
    deadline = time.monotonic() + 30
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    while b"time.sleep(120)" not in cmdline.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.005)
    return proc


# ----------------------------------------------------------------------------- topologies


def test_every_topology_file_loads_and_renders():
    assert lab.available_topologies(REPO) == TOPOLOGY_NAMES
    for name in TOPOLOGY_NAMES:
        topo = lab.load_topology(REPO, name)
        assert topo.name == name
        assert topo.description
        assert topo.cpus == topo.expect["cpus"] == (48 if name == "server-nps2" else 8)
        argv = lab.topology_argv(topo)
        assert argv[argv.index("-smp") + 1].startswith("%d," % topo.cpus)


def test_server_nps2_argv_is_two_sockets_four_nodes_smt():
    argv = lab.topology_argv(lab.load_topology(REPO, "server-nps2"))
    assert argv[argv.index("-smp") + 1] == "48,sockets=2,dies=4,cores=3,threads=2"
    nodes = [a for a in argv if a.startswith("node,nodeid=")]
    assert nodes == [
        "node,nodeid=%d,cpus=%d-%d,memdev=m%d" % (n, 12 * n, 12 * n + 11, n) for n in range(4)
    ]


def test_epyc_2ccx_argv():
    argv = lab.topology_argv(lab.load_topology(REPO, "epyc-2ccx"))
    assert argv == [
        "-cpu", "EPYC-Milan,check=off",
        "-smp", "8,sockets=1,dies=2,cores=4,threads=1",
        "-m", "2048M",
        "-object", "memory-backend-ram,id=m0,size=1024M",
        "-numa", "node,nodeid=0,cpus=0-3,memdev=m0",
        "-object", "memory-backend-ram,id=m1,size=1024M",
        "-numa", "node,nodeid=1,cpus=4-7,memdev=m1",
    ]  # fmt: skip


def test_vmware_like_argv_escapes_commas_in_smbios():
    argv = lab.topology_argv(lab.load_topology(REPO, "vmware-like"))
    assert "-numa" not in argv
    assert argv[argv.index("-cpu") + 1] == "EPYC,check=off,tcg-cpuid=off"
    smbios = [argv[i + 1] for i, a in enumerate(argv) if a == "-smbios"]
    assert any(
        s.startswith("type=1,manufacturer=VMware,, Inc.,product=VMware Virtual Platform")
        for s in smbios
    )


def test_non_contiguous_numa_cpus_repeat_the_cpus_option():
    topo = lab.topology_from_dict(
        {
            "name": "odd",
            "cpu": {"model": "EPYC"},
            "smp": {"sockets": 1, "cores": 4},
            "memory_mib": 1024,
            "numa": [{"cpus": "0,2", "memory_mib": 512}, {"cpus": "1,3", "memory_mib": 512}],
        }
    )
    argv = lab.topology_argv(topo)
    assert "node,nodeid=0,cpus=0,cpus=2,memdev=m0" in argv


@pytest.mark.parametrize(
    ("numa", "message"),
    [
        ([{"cpus": "0-3", "memory_mib": 512}, {"cpus": "3-7", "memory_mib": 512}], "overlaps"),
        ([{"cpus": "0-3", "memory_mib": 512}, {"cpus": "4-8", "memory_mib": 512}], "exceeds"),
        ([{"cpus": "0-3", "memory_mib": 512}], "cover"),
        ([{"cpus": "0-3", "memory_mib": 512}, {"cpus": "4-7", "memory_mib": 100}], "add up"),
    ],
)
def test_bad_numa_layouts_are_rejected(numa, message):
    doc = {
        "name": "bad",
        "cpu": {"model": "EPYC"},
        "smp": {"sockets": 1, "dies": 2, "cores": 4},
        "memory_mib": 1024,
        "numa": numa,
    }
    with pytest.raises(lab.LabError, match=message):
        lab.topology_from_dict(doc)


def test_an_intel_vendor_with_dies_needs_the_cpuid_level_kept():
    data = yaml.safe_load((REPO / "lab/topologies/server-nps2.yml").read_text())
    data["cpu"]["flags"].remove("full-cpuid-auto-level=off")
    with pytest.raises(lab.LabError, match=r"needs 'full-cpuid-auto-level=off' in cpu\.flags"):
        lab.topology_from_dict(data, source="t.yml")
    data["smp"]["dies"] = 1  # one die: QEMU offers no leaf 0x1f, nothing to keep
    data["smp"]["cores"] = 12
    assert lab.topology_from_dict(data).dies == 1


def test_unknown_topology_lists_the_known_ones():
    with pytest.raises(lab.LabError, match="known: ccx-smt, dual-socket"):
        lab.load_topology(REPO, "nope")


# ----------------------------------------------------------------------------- QEMU argv


def test_qemu_argv_is_loopback_daemonised_and_pidfiled(tmp_path):
    host = lab.Host(name="h1", topology="epyc-2ccx", port=40022)
    key = tmp_path / "ssh" / "id_ed25519"
    argv = lab.qemu_argv(tmp_path, host, lab.load_topology(REPO, "epyc-2ccx"), key)
    joined = " ".join(argv)
    assert argv[0] == "qemu-system-x86_64"
    assert "hostfwd=tcp:127.0.0.1:40022-:22" in joined
    assert argv[argv.index("-accel") + 1] == "tcg,thread=multi"
    assert argv[argv.index("-pidfile") + 1] == str(tmp_path / "hosts/h1/qemu.pid")
    assert argv[argv.index("-serial") + 1] == f"file:{tmp_path}/hosts/h1/serial.log"
    assert "-daemonize" in argv
    assert f"name=opt/rtfleet/authorized_keys,file={key}.pub" in argv
    assert "name=opt/rtfleet/hostname,string=h1" in argv
    # The overlay path is the marker that pid checks look for in /proc/<pid>/cmdline.
    assert str(lab.overlay_path(tmp_path, "h1")) in joined
    assert ",cache=unsafe," in joined
    host.disk_cache = "writeback"  # the fault drills: the guest's flushes reach the host
    assert ",cache=writeback," in " ".join(
        lab.qemu_argv(tmp_path, host, lab.load_topology(REPO, "epyc-2ccx"), key)
    )


# ----------------------------------------------------------------------------- inventory


def test_inventory_lists_hosts_in_lab_and_topology_groups(state):
    lab.save_host(state, lab.Host(name="epyc1", topology="epyc-2ccx", port=40001))
    lab.save_host(state, lab.Host(name="vmw1", topology="vmware-like", port=40002))
    path = lab.write_inventory(state)
    assert path == state / "inventory.yml"
    inventory = yaml.safe_load(path.read_text())
    children = inventory["all"]["children"]
    assert set(children) == {"lab", "epyc_2ccx", "vmware_like"}
    epyc1 = children["lab"]["hosts"]["epyc1"]
    assert epyc1["ansible_host"] == "127.0.0.1"
    assert epyc1["ansible_port"] == 40001
    assert epyc1["ansible_user"] == "lab"
    assert epyc1["ansible_ssh_private_key_file"] == str(state / "ssh" / "id_ed25519")
    assert epyc1["ansible_python_interpreter"] == "/usr/bin/python3"
    assert epyc1["rtfleet_lab_topology"] == "epyc-2ccx"
    assert list(children["vmware_like"]["hosts"]) == ["vmw1"]


def test_inventory_is_valid_for_ansible(state, tmp_path):
    ansible_inventory = shutil.which("ansible-inventory") or str(
        Path(sys.executable).with_name("ansible-inventory")
    )
    if not Path(ansible_inventory).exists():
        pytest.skip("ansible-inventory not installed")
    lab.save_host(state, lab.Host(name="epyc1", topology="epyc-2ccx", port=40001))
    path = lab.write_inventory(state)
    (tmp_path / "ansible.cfg").write_text("[defaults]\n")
    result = subprocess.run(
        [ansible_inventory, "-i", str(path), "--list"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "ANSIBLE_CONFIG": str(tmp_path / "ansible.cfg")},
    )
    data = json.loads(result.stdout)
    assert data["_meta"]["hostvars"]["epyc1"]["ansible_port"] == 40001
    assert data["epyc_2ccx"]["hosts"] == ["epyc1"]


def test_empty_state_writes_an_empty_lab_group(state):
    inventory = yaml.safe_load(lab.write_inventory(state).read_text())
    assert inventory == {"all": {"children": {"lab": {"hosts": {}}}}}


# ----------------------------------------------------------------------------- ports


def test_free_port_is_bindable_and_skips_excluded():
    port = lab.free_port()
    assert 1024 < port < 65536
    assert lab.port_is_free(port)
    assert lab.free_port(exclude={port}) != port


def test_port_in_use_is_not_free():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert not lab.port_is_free(sock.getsockname()[1])


# ----------------------------------------------------------------------------- pidfiles


def test_pid_alive_checks_the_marker(tmp_path):
    proc = sleeper("/lab/hosts/h1/overlay.qcow2")
    try:
        assert lab.pid_alive(proc.pid)
        assert lab.pid_alive(proc.pid, "/lab/hosts/h1/overlay.qcow2")
        assert not lab.pid_alive(proc.pid, "/lab/hosts/h2/overlay.qcow2")
    finally:
        proc.kill()
        proc.wait()
    assert not lab.pid_alive(proc.pid)


def test_stop_process_terminates_and_removes_the_pidfile(tmp_path):
    marker = str(tmp_path / "overlay.qcow2")
    proc = sleeper(marker)
    pidfile = tmp_path / "qemu.pid"
    pidfile.write_text(f"{proc.pid}\n")
    assert lab.stop_process(pidfile, marker, timeout=5) is True
    assert proc.wait(timeout=5) is not None
    assert not pidfile.exists()


def test_power_off_kills_at_once_and_keeps_the_overlay(state):
    overlay = lab.overlay_path(state, "h1")
    overlay.parent.mkdir(parents=True)
    overlay.write_text("disk")
    # A process that ignores SIGTERM, as a guest mid-shutdown would not get the chance to.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)",
            str(overlay),
        ]
    )
    lab.pidfile_path(state, "h1").write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + 5
    while (
        str(overlay) not in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    assert lab.power_off(state, "h1") == proc.pid
    assert proc.wait(timeout=5) == -signal.SIGKILL
    assert overlay.read_text() == "disk" and not lab.pidfile_path(state, "h1").exists()
    with pytest.raises(lab.LabError, match="not running: there is no power to cut"):
        lab.power_off(state, "h1")


def test_stop_process_leaves_a_recycled_pid_alone(tmp_path):
    proc = sleeper("something-else")
    pidfile = tmp_path / "qemu.pid"
    pidfile.write_text(str(proc.pid))
    try:
        assert lab.stop_process(pidfile, str(tmp_path / "overlay.qcow2")) is False
        assert proc.poll() is None, "a process without the marker must not be signalled"
        assert not pidfile.exists()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("content", ["", "garbage", "-1", "0"])
def test_unusable_pidfiles_are_stale(tmp_path, content):
    pidfile = tmp_path / "qemu.pid"
    pidfile.write_text(content)
    assert lab.read_pid(pidfile) is None
    assert lab.stop_process(pidfile, "x") is False
    assert not pidfile.exists()


def test_pidfile_of_an_exited_process_is_stale(tmp_path):
    proc = subprocess.Popen(["true"])
    proc.wait()
    pidfile = tmp_path / "qemu.pid"
    pidfile.write_text(str(proc.pid))
    assert lab.stop_process(pidfile, None) is False


# ----------------------------------------------------------------------------- commands


def fake_host(state: Path, name: str, topology: str, port: int) -> subprocess.Popen:
    """A host record plus a live process that looks like its QEMU (argv holds the overlay)."""
    lab.save_host(state, lab.Host(name=name, topology=topology, port=port))
    overlay = lab.overlay_path(state, name)
    overlay.write_text("")
    lab.serial_log_path(state, name).write_text("boot\n")
    proc = sleeper(f"file={overlay},format=qcow2")
    lab.pidfile_path(state, name).write_text(str(proc.pid))
    lab.write_inventory(state)
    return proc


def test_status_and_down_with_a_stand_in_process(state, capsys):
    proc = fake_host(state, "h1", "epyc-2ccx", 40001)
    gone = fake_host(state, "h2", "vmware-like", 40002)
    gone.kill()
    gone.wait()
    try:
        assert run_cli("lab", "status", "--format", "json") == 0
        rows = {row["host"]: row for row in json.loads(capsys.readouterr().out)["hosts"]}
        assert rows["h1"]["alive"] is True
        assert rows["h1"]["pid"] == proc.pid
        assert rows["h2"]["alive"] is False

        assert run_cli("lab", "down", "h1") == 0
        assert proc.wait(timeout=10) is not None
        assert not lab.host_dir(state, "h1").exists()
        assert (state / "logs" / "h1.serial.log").read_text() == "boot\n"
        hosts = yaml.safe_load((state / "inventory.yml").read_text())["all"]["children"]["lab"]
        assert list(hosts["hosts"]) == ["h2"]

        assert run_cli("lab", "down", "--all") == 0
        assert not list((state / "hosts").iterdir())
    finally:
        proc.kill()
        proc.wait()


def test_boot_timeout_stops_the_host_and_shows_the_serial_log(state):
    proc = fake_host(state, "h1", "epyc-2ccx", lab.free_port())  # nothing listens on it
    lab.serial_log_path(state, "h1").write_text("".join(f"line {i}\n" for i in range(100)))
    host = lab.load_hosts(state)["h1"]
    try:
        with pytest.raises(lab.LabError, match="no ssh after 1 s") as err:
            lab.wait_for_ssh(state, host, timeout=1)
        assert "line 99" in str(err.value)
        assert "line 69" not in str(err.value), "only the tail of the serial log"
        assert proc.wait(timeout=10) is not None
        assert not lab.pidfile_path(state, "h1").exists()
    finally:
        proc.kill()
        proc.wait()


def test_a_guest_that_hung_in_boot_is_told_apart_from_a_slow_one(state):
    """An idle QEMU without ssh is a hang (BootHang, which `lab up` boots once more); a
    busy one is still booting and gets its full timeout."""
    idle = fake_host(state, "h1", "epyc-2ccx", lab.free_port())
    try:
        started = time.monotonic()
        with pytest.raises(lab.BootHang, match=r"hung: QEMU used 0\.\d s of CPU in \d+ s, no ssh"):
            lab.wait_for_ssh(state, lab.load_hosts(state)["h1"], timeout=120, hang_window_s=4)
        assert time.monotonic() - started < 60
        assert idle.wait(timeout=10) is not None
    finally:
        idle.kill()
        idle.wait()
    lab.save_host(state, lab.Host(name="h2", topology="epyc-2ccx", port=lab.free_port()))
    overlay = lab.overlay_path(state, "h2")
    overlay.write_text("")
    busy = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nend = time.time() + 60\nwhile time.time() < end: pass",
            f"file={overlay},format=qcow2",
        ]
    )
    lab.pidfile_path(state, "h2").write_text(str(busy.pid))
    try:
        time.sleep(0.5)  # exec'd: its argv carries the overlay
        with pytest.raises(lab.LabError, match="no ssh after 12 s") as err:
            lab.wait_for_ssh(state, lab.load_hosts(state)["h2"], timeout=12, hang_window_s=4)
        assert not isinstance(err.value, lab.BootHang)
    finally:
        busy.kill()
        busy.wait()


def test_boot_fails_fast_when_qemu_dies(state):
    proc = fake_host(state, "h1", "epyc-2ccx", lab.free_port())
    proc.kill()
    proc.wait()
    with pytest.raises(lab.LabError, match="QEMU exited while booting"):
        lab.wait_for_ssh(state, lab.load_hosts(state)["h1"], timeout=300)


def test_down_needs_names_or_all(state, capsys):
    assert run_cli("lab", "down") == 1
    assert "--all" in capsys.readouterr().err


def test_up_without_an_image_says_how_to_build_it(state, capsys, monkeypatch):
    monkeypatch.setattr(lab.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    assert run_cli("lab", "up", "h1=epyc-2ccx") == 1
    err = capsys.readouterr().err
    assert "rtfleet lab image" in err
    assert "not found" in err


def test_up_without_qemu_says_what_to_install(state, capsys, monkeypatch):
    monkeypatch.setattr(lab.shutil, "which", lambda tool: None)
    assert run_cli("lab", "up", "--topology", "epyc-2ccx") == 1
    assert "apt-get install qemu-system-x86 qemu-utils" in capsys.readouterr().err


def test_the_installed_qemu_reports_a_version_the_lab_reads():
    if shutil.which(lab.QEMU_BINARY) is None:
        pytest.skip("qemu-system-x86_64 not installed")
    result = subprocess.run(
        [lab.QEMU_BINARY, "--version"], capture_output=True, text=True, check=True
    )
    out = result.stdout
    assert lab.qemu_major(out) is not None, out


@pytest.mark.parametrize(
    ("version", "major"),
    [
        ("QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)\nCopyright", 7),
        ("QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)\n", 10),
        ("qemu-system-x86_64: error while loading shared libraries\n", None),
        ("", None),
    ],
)
def test_qemu_major(version, major):
    assert lab.qemu_major(version) == major


def test_large_guests_on_an_old_qemu_get_a_one_line_warning(tmp_path, monkeypatch):
    # A stand-in for the QEMU binary that prints what QEMU 7.2 and 10 print.
    fake = tmp_path / lab.QEMU_BINARY
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    topologies = {name: lab.load_topology(REPO, name) for name in ("server-nps2", "epyc-2ccx")}
    for version, warned in (("7.2.22", True), ("10.0.2", False), ("garbage", True)):
        fake.write_text(f"#!/bin/sh\necho 'QEMU emulator version {version} (Debian)'\n")
        fake.chmod(0o755)
        warning = lab.warn_old_qemu(topologies)
        if not warned:
            assert warning is None
            continue
        assert warning.startswith("warning: server-nps2: QEMU ")
        assert "\n" not in warning
        assert "lab/install-deps.sh" in warning
    assert lab.warn_old_qemu({"epyc-2ccx": topologies["epyc-2ccx"]}) is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["h1"], "HOST=TOPOLOGY"),
        (["Bad_Name=epyc-2ccx"], "host name"),
        (["h1=epyc-2ccx", "h1=vmware-like"], "unique"),
        (["h1=no-such-topology"], "unknown topology"),
        ([], "nothing to bring up"),
    ],
)
def test_up_rejects_bad_host_specs(state, capsys, argv, message):
    assert run_cli("lab", "up", *argv) == 1
    assert message in capsys.readouterr().err


def test_image_hash_matches_the_builder_script(tmp_path):
    result = subprocess.run(
        ["bash", str(REPO / "lab" / "build-image.sh"), "--print-path"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "RTFLEET_CACHE_DIR": str(tmp_path)},
    )
    assert result.stdout.strip() == str(
        tmp_path / "images" / f"debian12-rtfleet-{lab.image_hash(REPO / 'lab')}.qcow2"
    )


@pytest.mark.parametrize("name", ["epyc-2ccx", "vmware-like"])
def test_captured_guest_trees_match_their_expect_blocks(tmp_path, name):
    """The sysfs trees captured from booted lab guests, read by rtfleet's topology reader,
    summarise to exactly what each topology's `expect` block says."""
    import tarfile

    from rtfleet.topology import read_topology

    with tarfile.open(REPO / "tests" / "fixtures" / "sysfs" / f"lab-{name}.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    expect = lab.load_topology(REPO, name).expect
    seen = lab.summarise_topology(read_topology(str(tmp_path)), expect["virtualization"])
    assert lab.compare_expect(expect, seen) == []


def test_the_probe_script_reads_a_topology_with_nothing_of_rtfleet_installed(trees):
    """What `lab probe` pipes to a guest's python3: the reader's modules and a footer, run
    here by a Python without site-packages, reads what read_topology reads."""
    from rtfleet.topology import read_topology

    root = str(trees("epyc-7702p-nps4"))
    script = lab.probe_script(f"import json\nprint(json.dumps(read_topology({root!r})))\n")
    run = subprocess.run(
        [sys.executable, "-I", "-S", "-"],
        input=script,
        capture_output=True,
        text=True,
        check=False,
        cwd="/",
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == json.loads(json.dumps(read_topology(root)))


# ----------------------------------------------------------------------------- real VM


@pytest.mark.vm
def test_epyc_2ccx_guest_shows_its_topology(tmp_path, monkeypatch, request):
    """Boot epyc-2ccx under QEMU and read its CPU/cache/NUMA layout over ssh (2-3 min).

    Opt-in (`pytest -m vm` or RTFLEET_LAB_VM=1): a plain `pytest` must not boot VMs.
    """
    markexpr = request.config.getoption("markexpr") or ""
    if os.environ.get("RTFLEET_LAB_VM") != "1" and ("vm" not in markexpr or "not vm" in markexpr):
        pytest.skip("boots a VM: run with `pytest -m vm` or RTFLEET_LAB_VM=1")
    if shutil.which(lab.QEMU_BINARY) is None or shutil.which("qemu-img") is None:
        pytest.skip("qemu-system-x86_64/qemu-img not installed")
    image = lab.image_path(REPO)
    if not image.is_file():
        pytest.skip(f"lab image {image} not built (rtfleet lab image)")
    state = tmp_path / "state"
    monkeypatch.setenv("RTFLEET_LAB_DIR", str(state))
    name = f"pytest-{os.getpid()}"
    try:
        start = time.monotonic()
        assert run_cli("lab", "up", f"{name}=epyc-2ccx") == 0
        print(f"epyc-2ccx ssh-ready after {time.monotonic() - start:.0f} s")
        host = lab.load_hosts(state)[name]
        seen = lab.probe_host(state, host)
        assert seen["numa_nodes"] == ["0-3", "4-7"]
        assert seen["l3_groups"] == ["0-3", "4-7"]
        assert lab.compare_expect(lab.load_topology(REPO, "epyc-2ccx").expect, seen) == []
    finally:
        run_cli("lab", "down", "--all")
    assert not lab.host_dir(state, name).exists()
