"""shminfer's sd_notify: real datagrams on a real AF_UNIX socket, as systemd reads them."""

import os
import socket

from shminfer.sdnotify import Notifier


def _listener(tmp_path):
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    return sock, path


def test_ready_status_and_watchdog_reach_the_socket(tmp_path):
    sock, path = _listener(tmp_path)
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
    n = Notifier(env)
    assert n.enabled and n.watchdog_interval_s == 1.0
    assert n.ready("4 workers ready")
    assert sock.recv(256) == b"READY=1\nSTATUS=4 workers ready"
    assert n.watchdog(now=100.0)
    assert sock.recv(256) == b"WATCHDOG=1"
    # Not again before half the period has passed.
    assert not n.watchdog(now=100.5)
    assert n.watchdog(now=101.1)
    assert sock.recv(256) == b"WATCHDOG=1"
    n.close()


def test_abstract_socket_name(tmp_path):
    name = "rtfleet-test-%d" % os.getpid()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    assert Notifier({"NOTIFY_SOCKET": "@" + name}).stopping()
    assert sock.recv(64) == b"STOPPING=1"


def test_no_socket_is_a_no_op_and_another_pids_watchdog_is_ignored(tmp_path):
    assert not Notifier({}).ready()
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone"), "WATCHDOG_USEC": "1000000"})
    assert not n.ready()  # nobody listens: False, no exception
    other = Notifier({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
    assert other.watchdog_interval_s is None


def test_serve_tells_systemd_ready_watchdog_and_stopping(tmp_path):
    """A real `shminfer serve` under a notify socket, as systemd runs a Type=notify unit."""
    import signal
    import subprocess
    import sys
    import uuid

    sock, path = _listener(tmp_path)
    sock.settimeout(60)
    cpu = sorted(os.sched_getaffinity(0))[-1]
    env = {**os.environ, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"}
    argv = [sys.executable, "-m", "shminfer.cli", "serve", "--name", "n" + uuid.uuid4().hex[:8]]
    argv += ["--cpus", str(cpu), "--numa-node", "-1", "--backend", "echo", "--sched", "off"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        messages = []
        while not any(m.startswith(b"READY=1") for m in messages):
            messages.append(sock.recv(256))
        assert b"READY=1\nSTATUS=1 workers ready" in messages
        # The loop keeps pinging at half the period while it runs.
        pings = [sock.recv(256) for _ in range(3)]
        assert pings == [b"WATCHDOG=1"] * 3
        proc.send_signal(signal.SIGTERM)
        while sock.recv(256) != b"STOPPING=1":
            pass
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
