"""A sampler in a container reaches the runtime through one read-only mount of the run
directory (/run/shminfer on a host): no /dev/shm, no host IPC namespace.

The client runs as a pod's would: in mount and pid namespaces of its own with its own /proc
(``unshare``; the server's pid is not there)
where the server's run directory is bind-mounted read-only at another path, as user
nobody, with or without the server's group as a supplementary group (the manifest's
``supplementalGroups``). Then what a server must refuse in its own directory, and bad
settings. Mounting and changing user need root; the rest runs as anyone.
"""

from __future__ import annotations

import grp
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from shminfer_serving import CPUS, serving

from shminfer import cli
from shminfer.queue import QueueError
from shminfer.registry import make_unit_dir, read_registry, run_dir, unit_dir
from shminfer.server import Server

# Everything is imported before the switch to nobody: this machine's Python may live where
# nobody can read (pyenv under /root); a container's image would have its own.
POD = r"""
import json, os, subprocess, sys
import numpy as np
import rtfleet.topology
import shminfer.locality
from shminfer.client import Client
from shminfer.queue import QueueError
source, mount, groups, match, cpu = sys.argv[1:6]
if source != "-":
    os.makedirs(mount)
    subprocess.run(["mount", "--bind", "-o", "ro", source, mount], check=True)
os.setgroups([int(g) for g in groups.split(",") if g])
os.setgid(65534)
os.setuid(65534)
os.environ["SHMINFER_DIR"] = mount
try:
    with Client.nearest(cpus=[int(cpu)], match=match, timeout=20) as client:
        client.wait_ready(30)
        y = client.infer({"x": np.full((1, 8), 7.0, np.float32)}, timeout=30)["y"]
        seg = client.lanes[0].seg
        owners = sorted({seg.slot_get(i, "owner_pid") for i in range(seg.slot_count)} - {0})
        print(json.dumps({"unit": client.choice.name, "y": float(y.sum()), "pid": os.getpid(),
                          "owners": owners}))
except QueueError as exc:
    print("error: " + str(exc))
"""

GROUP = "users"


def _pod(source, *, groups=(), match="*"):
    """Run the client as a pod: mount ``source`` read-only at a fresh path, become nobody
    with supplementary ``groups``; its one line of output (JSON answer or ``error: ...``)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare(1) to mount and change user like a container")
    # Not under tmp_path: pytest makes its parents 0700, and nobody must reach the mount.
    pod_root = Path(tempfile.mkdtemp(prefix="pod-"))
    pod_root.chmod(0o755)
    mount = pod_root / "run" / "shminfer"
    try:
        out = _run_pod(source, mount, groups, match)
    finally:
        shutil.rmtree(pod_root, ignore_errors=True)  # the mount went with the namespace
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout + out.stderr
    return lines[0]


def _run_pod(source, mount, groups, match):
    return subprocess.run(
        [
            "unshare",
            "--mount",
            "--pid",
            "--fork",
            "--mount-proc",
            sys.executable,
            "-c",
            POD,
            str(source),
            str(mount),
            ",".join(str(g) for g in groups),
            match,
            str(CPUS[0]),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def group_server():
    try:
        gid = grp.getgrnam(GROUP).gr_gid
    except KeyError:
        pytest.skip(f"no group {GROUP!r} on this machine")
    with serving(cpus=CPUS[-1:], server_options={"group": GROUP}) as server:
        yield server, gid


def test_a_pod_in_the_group_infers_through_a_read_only_mount_of_the_run_directory(
    tmp_path, group_server
):
    server, gid = group_server
    answer = json.loads(_pod(run_dir(), groups=[gid], match=server.name))
    assert answer["unit"] == server.name
    assert answer["y"] == 2 * 8 * 7.0  # echo: y is x twice
    # In its own pid namespace the pod is pid 1; the server records the pid the kernel
    # gives it (SO_PEERCRED, in the server's namespace), never the client's word for it.
    assert answer["pid"] == 1
    assert len(answer["owners"]) == 1 and answer["owners"][0] > 1, answer


def test_a_pod_without_the_group_is_told_which_group_to_add(tmp_path, group_server):
    server, gid = group_server
    line = _pod(run_dir(), match=server.name)
    assert line.startswith("error: no usable shminfer unit matching"), line
    assert f"supplementalGroups: [{gid}]" in line, line


def test_a_pod_mounting_the_wrong_path_is_told_what_to_mount(tmp_path, group_server):
    server, gid = group_server
    # Mounted nowhere (the pod's /run/shminfer is absent), then the host's /dev/shm
    # mounted where the run directory should be: neither holds the server.
    line = _pod("-", groups=[gid], match=server.name)
    assert "is missing: no shminfer server runs here" in line, line
    line = _pod("/dev/shm", groups=[gid], match=server.name)
    assert line.startswith(f"error: no running shminfer unit matching '{server.name}' in "), line
    assert line.endswith("/run/shminfer (is the runtime deployed?)"), line


def test_the_server_directory_is_its_own_and_closed_to_others():
    with serving() as server:
        path = Path(unit_dir(server.name))
        st = path.lstat()
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
        assert stat.S_IMODE(st.st_mode) == 0o700  # no --group: nobody else at all
        assert sorted(os.listdir(path)) == ["registry.json", "server.lock", "server.sock"]
    assert os.listdir(path) == []  # a stopped server leaves its (empty) directory only


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant a stranger's directory")
def test_a_server_refuses_a_directory_someone_else_planted_at_its_name(tmp_path):
    name = f"m{uuid.uuid4().hex[:10]}"
    planted = Path(unit_dir(name))
    planted.mkdir(mode=0o777)
    os.chown(planted, 65534, 65534)
    try:
        with pytest.raises(QueueError, match=r"belongs to uid 65534, not this server's user"):
            Server(name, CPUS[-1:], numa_node=-1, backend="echo").start()
        # A client will not read a registry from it either, even one that looks right.
        Path(planted, "registry.json").write_text('{"pid": 1, "workers": []}')
        with pytest.raises(QueueError, match="not a trusted server user"):
            read_registry(name)
    finally:
        shutil.rmtree(planted)
    planted.symlink_to(tmp_path)
    try:
        with pytest.raises(QueueError, match="not a directory"):
            Server(name, CPUS[-1:], numa_node=-1, backend="echo").start()
        with pytest.raises(QueueError, match="not a directory"):
            read_registry(name)
    finally:
        planted.unlink()


def test_a_group_writable_server_directory_is_refused_by_clients():
    with serving() as server:
        path = unit_dir(server.name)
        os.chmod(path, 0o770)
        with pytest.raises(QueueError, match="writable by group or others"):
            read_registry(server.name)
        os.chmod(path, 0o700)
        assert read_registry(server.name)["name"] == server.name


def test_bad_run_directories_are_one_line_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHMINFER_DIR", "run/shminfer")
    with pytest.raises(QueueError, match="must be an absolute path"):
        make_unit_dir("x")
    assert cli.main(["where"]) == 2
    assert "SHMINFER_DIR='run/shminfer' must be an absolute path" in capsys.readouterr().err
    monkeypatch.setenv("SHMINFER_DIR", str(tmp_path / "absent"))
    assert cli.main(["where"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "absent is missing" in err and "hostPath" in err
    monkeypatch.setenv("SHMINFER_DIR", "/proc/shminfer")  # not even root may make it
    with pytest.raises(QueueError, match=r"^cannot make /proc/shminfer/x .*or set SHMINFER_DIR"):
        make_unit_dir("x")
