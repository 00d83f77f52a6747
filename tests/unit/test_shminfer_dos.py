"""shminfer against one peer (or one setting) that would deny a unit to every other sampler
(issue 27): each attack on real processes (`shminfer serve` subprocesses, real sockets and
shared memory), on the C and the pure path (`make unit` runs this file twice). Each test
failed on the main branch before the fix it covers."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from shminfer_attacks import (
    LEASE_LINES,
    MISALIGNED_READY,
    WIDTH,
    answer_line,
    bad_payloads,
    flood,
    foreign_clock,
    leave_with_state,
    misaligned_ready,
    overwrite_magic,
    second_lease_line,
    send_lease_line,
    serve,
)
from shminfer_serving import CPUS, attach, wait_for
from shminfer_serving import serving as _serving

from shminfer import _sys
from shminfer.client import Client
from shminfer.codec import PayloadError
from shminfer.limits import cgroup_memory_limit
from shminfer.queue import (
    DONE,
    FREE,
    PROCESSING,
    QUEUE_WAIT_MAX_NS,
    READY,
    RING_FIELDS,
    QueueError,
    Segment,
)
from shminfer.registry import make_unit_dir, registry_path, socket_path, unit_dir
from shminfer.topology import read_topology


def _x(value, rows=1):
    return {"x": np.full((rows, WIDTH), value)}


def _serve(name, *extra, slots=8, limit_nofile=None):
    """`shminfer serve` (shminfer_attacks.serve): its stderr (the journal) in a file."""
    log = open(Path(unit_dir(name)).parent / f"{name}.log", "w+", encoding="utf-8")  # noqa: SIM115
    proc = serve(name, *extra, limit_nofile=limit_nofile, stderr=log, slots=slots)
    proc.log = log
    return proc


def _journal(proc):
    proc.log.flush()
    proc.log.seek(0)
    return proc.log.read()


def _stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    proc.log.close()


def _client(name, timeout=30.0, retry=("no shminfer server", "not running", "is missing"), **kw):
    """A client, retrying while the server comes up (or what ``retry`` names lasts)."""
    return attach(name, timeout, retry, **kw)


@contextlib.contextmanager
def unit(*extra, **kwargs):
    """A running `shminfer serve` that has answered one request; stopped at the end."""
    name = f"d{uuid.uuid4().hex[:10]}"
    proc = _serve(name, *extra, **kwargs)
    try:
        with _client(name) as client:
            client.wait_ready(60)
            assert np.all(client.infer(_x(1.0), timeout=30)["y"] == 1.0)
        yield name, proc
        assert proc.poll() is None, f"the unit exited ({proc.returncode}): {_journal(proc)}"
    finally:
        _stop(proc)


def _serves(name, value=5.0, **kw):
    with _client(name, **kw) as client:
        out = client.infer(_x(value), timeout=30)["y"]
    return bool(np.all(out == value))


def test_no_lease_line_kills_the_lease_thread():
    """Each line gets one line of error and that peer alone is dropped; clients attach."""
    with unit() as (name, _proc):
        for label, line in LEASE_LINES.items():
            answer, dropped = send_lease_line(name, line)
            assert answer["ok"] is False and "bad request" in answer["error"], label
            assert dropped, f"{label}: the peer was not dropped"
            assert _serves(name), label


# ---------------------------------------------------------------- 2: one lease per connection


def test_a_second_lease_line_is_refused_and_close_returns_every_slot():
    with unit(slots=8) as (name, _proc):
        first, second = second_lease_line(name)
        assert first["ok"] is True
        assert second["ok"] is False and "one lease per connection" in second["error"]
        # Every slot came back: one client can lease all 8 again.
        with _client(name, timeout=10, retry=("no free slot",), slots_per_worker=8) as client:
            assert len(client.lanes[0].leased) == 8
            assert np.all(client.infer(_x(3.0), timeout=30)["y"] == 3.0)


# ---------------------------------------------------------------- 3: descriptors


def test_a_connection_flood_is_capped_silent_peers_go_and_the_unit_keeps_accepting():
    """Soft RLIMIT_NOFILE 200, one worker: a cap of 200 - 64 - 8 = 128 connections. A peer
    opening 250 (and sending nothing) gets the rest refused with one line; an honest client
    is told so meanwhile, and attaches once the silent ones are dropped (10 s handshake)."""
    with unit(limit_nofile=200) as (name, proc):
        socks = flood(name, 250)
        try:
            assert len(socks) == 250
            refused = []
            for sock in socks[-50:]:
                with contextlib.suppress(TimeoutError, ConnectionResetError):
                    refused.append(answer_line(sock, timeout=10)["error"])
            assert refused and all("too many connections" in e for e in refused), refused
            with pytest.raises(QueueError, match="too many connections"):
                Client(name, timeout=10)
            assert _serves(name, retry=("too many connections",), timeout=40)
        finally:
            for sock in socks:
                sock.close()
        assert _serves(name)
        assert "Traceback" not in _journal(proc)


_NO_CAP = """
import os, resource, sys
from shminfer.server import Server
server = Server(sys.argv[1], [int(sys.argv[2])], numa_node=-1, backend="echo", model="32",
                slots=8, worker_options={"sched": "off"})
server.max_connections = 10**6  # past the cap: accept itself runs out of descriptors
server.start()
used, hard = len(os.listdir("/proc/self/fd")), resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (used + 40, hard))
print("serving", flush=True)
try:
    server.serve_forever()
finally:
    server.stop()
"""


def test_out_of_descriptors_accept_pauses_and_retries_never_exits():
    """The second defence, behind the cap: EMFILE on accept pauses it; once the flood has
    gone, clients attach again."""
    name = f"d{uuid.uuid4().hex[:10]}"
    proc = subprocess.Popen(
        [sys.executable, "-c", _NO_CAP, name, str(CPUS[-1])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "serving"
        socks = flood(name, 100)
        try:
            time.sleep(1)  # the server meets EMFILE meanwhile
            assert proc.poll() is None
        finally:
            for sock in socks:
                sock.close()
        assert _serves(name, retry=("no answer",), timeout=30)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert '"event": "accept_paused"' in err and "Too many open files" in err, err[-2000:]
    assert "Traceback" not in err, err[-2000:]


def test_a_full_listen_backlog_is_a_clear_error():
    """A server that does not accept (its backlog full): one line, not a BlockingIOError."""
    name = f"d{uuid.uuid4().hex[:10]}"
    make_unit_dir(name)
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stuck.bind(socket_path(name))
    os.chmod(socket_path(name), 0o600)
    stuck.listen(0)
    queued = []
    try:
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            queued.append(sock)
            try:
                sock.connect(socket_path(name))
            except BlockingIOError:
                break
        with pytest.raises(QueueError, match="listen backlog is full"):
            Client(name, timeout=0.5)
    finally:
        for sock in queued:
            sock.close()
        stuck.close()
        os.unlink(socket_path(name))


# ---------------------------------------------------------------- 4: reclaim by ownership


def test_slots_left_processing_come_back_when_their_client_leaves():
    """READY, WRITING, DONE and garbage came back already; PROCESSING the worker never
    wrote (it holds no claim) did not."""
    with unit(slots=8) as (name, _proc):
        assert len(leave_with_state(name, PROCESSING, slots=8)) == 8
        with _client(name, timeout=10, retry=("no free slot",), slots_per_worker=8) as client:
            assert len(client.lanes[0].leased) == 8
            assert np.all(client.infer(_x(4.0), timeout=30)["y"] == 4.0)


# ---------------------------------------------------------------- 5: one definition of READY


def test_ready_is_one_u32_compare_on_this_path():
    """The word 0x02000000 followed by FREE holds the byte pattern of READY one byte off
    the word boundary: not READY, for the Python scans and the C one alike."""
    segment = Segment.create(f"d{uuid.uuid4().hex[:8]}", slot_count=4, ring_records=4)
    try:
        words = segment.state_words
        cases = [
            ([0x02000000, FREE, FREE, FREE], []),
            ([FREE, 0x00020000, 0x00000200, 0x02000000], []),
            ([0x02000000, READY, FREE, READY], [1, 3]),
            ([READY, FREE, FREE, FREE], [0]),
        ]
        for states, ready in cases:
            for index, value in enumerate(states):
                words[index] = value
            assert segment.ready_slots() == ready, states
            assert segment.any_ready() == bool(ready), states
            if _sys.FAST is not None:
                assert _sys.FAST.spin_ready(segment._state_addr0, 4, 0) == bool(ready), states
    finally:
        segment.close()


def _cpu_seconds(pid):
    with open(f"/proc/{pid}/stat", "rb") as handle:
        fields = handle.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_word_that_looks_ready_off_its_boundary_neither_wakes_nor_feeds_the_worker():
    with unit(slots=8) as (name, _proc), Client(name, slots_per_worker=1) as peer:
        slot, worker = misaligned_ready(peer)
        before = _cpu_seconds(worker)
        time.sleep(3)
        used = _cpu_seconds(worker) - before
        assert peer.lanes[0].seg.state_words[slot] == MISALIGNED_READY, "taken for a request"
        # A spinning worker uses its CPU the whole time; an idle one next to nothing.
        assert used < 1.5, f"the idle worker used {used:.2f} s of CPU in 3 s"
        assert _serves(name)


# ---------------------------------------------------------------- 6: magic, backoff, health


def _restarts(path):
    text = Path(path).read_text(encoding="utf-8") if os.path.exists(path) else ""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("shminfer_worker_restarts_total{")
    )


def test_an_overwritten_magic_locks_nobody_out_and_a_dead_worker_restarts_once(tmp_path):
    metrics = tmp_path / "metrics.prom"
    with unit("--metrics-textfile", str(metrics), "--metrics-every-s", "0.5") as (name, _p):
        with Client(name, slots_per_worker=1) as peer:
            overwrite_magic(peer)
            os.kill(peer.lanes[0].seg.get("worker_pid"), signal.SIGKILL)
        assert _serves(name, timeout=30)  # a new client attaches and is answered
        time.sleep(3)
        assert _restarts(metrics) == 1, metrics.read_text(encoding="utf-8")


def test_the_restart_backoff_grows_while_restarted_workers_keep_dying():
    """Workers killed as soon as they start: the backoff doubles up to its maximum and a
    starting worker does not halve it."""
    with _serving("echo", slots=4, prefix="d", check_cleanup=False) as server:
        cpu = server.cpus[0]
        killed = set()
        deadline = time.monotonic() + 60
        while len(killed) < 6 and time.monotonic() < deadline:
            process = server.processes.get(cpu)
            if process is not None and process.pid not in killed and process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
                killed.add(process.pid)
            time.sleep(0.005)
        assert len(killed) == 6
        wait_for(lambda: server.processes.get(cpu) is not None, 30, "the next restart")
        assert server.backoff[cpu] == server.backoff_max, server.backoff
        # A worker that loads and lives the maximum earns the minimum back.
        wait_for(lambda: server.backoff[cpu] == server.backoff_min, 60, "a fresh backoff")
        assert server.processes[cpu].pid not in killed


def test_a_unit_that_stops_serving_exits_2_saying_why():
    """A request READY for a worker that claims nothing (stopped here): the supervisor's
    health check fails, and after the grace the unit exits 2 with the reason; a healthy
    unit under the same thresholds keeps running."""
    name = f"d{uuid.uuid4().hex[:10]}"
    proc = _serve(name, "--health-every-s", "0.2", "--health-stuck-s", "1", "--health-grace-s", "1")
    worker = None
    try:
        with _client(name, slots_per_worker=1) as client:
            client.wait_ready(60)
            assert np.all(client.infer(_x(2.0), timeout=30)["y"] == 2.0)
            time.sleep(3)
            assert proc.poll() is None, _journal(proc)  # healthy: still serving
            worker = client.lanes[0].seg.get("worker_pid")
            os.kill(worker, signal.SIGSTOP)
            client.start(_x(3.0))
            proc.wait(30)
    finally:
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGCONT)
        journal = _journal(proc)
        _stop(proc)
    assert proc.returncode == 2, journal
    assert '"event": "unhealthy"' in journal and "claims nothing" in journal, journal
    assert journal.rstrip().splitlines()[-1].startswith("shminfer: error: "), journal


def test_a_unit_its_clients_cannot_attach_to_exits_2_saying_why():
    """Its socket gone (removed here; a unit whose lease thread died looked the same): no
    client can attach, the supervisor's own check says so, the unit exits 2."""
    name = f"d{uuid.uuid4().hex[:10]}"
    proc = _serve(name, "--health-every-s", "0.2", "--health-grace-s", "1")
    try:
        assert _serves(name)
        os.unlink(socket_path(name))
        proc.wait(30)
    finally:
        journal = _journal(proc)
        _stop(proc)
    assert proc.returncode == 2, journal
    assert "the supervisor's own client cannot attach" in journal, journal
    assert journal.rstrip().splitlines()[-1].startswith("shminfer: error: "), journal


def test_the_listen_backlog_is_somaxconn():
    if shutil.which("ss") is None:
        pytest.skip("no ss(8) to read a listening socket's backlog")
    with unit() as (name, _proc):
        listed = subprocess.run(
            ["ss", "-xlH", "src", socket_path(name)], capture_output=True, text=True, check=True
        ).stdout.split()
        assert int(listed[3]) == min(socket.SOMAXCONN, _somaxconn()), listed


def _somaxconn():
    with open("/proc/sys/net/core/somaxconn", encoding="ascii") as handle:
        return int(handle.read())


# ---------------------------------------------------------------- 7: memory cgroup


def test_the_tightest_memory_max_on_the_cgroup_path_is_the_limit(tmp_path):
    root = tmp_path / "cgroup"
    leaf = root / "rtfleet.slice" / "shminfer@ccx0.service"
    leaf.mkdir(parents=True)
    (leaf / "memory.max").write_text("max\n")
    (leaf.parent / "memory.max").write_text("1073741824\n")
    (root / "memory.max").write_text("2147483648\n")
    proc_cgroup = tmp_path / "cgroup.txt"
    proc_cgroup.write_text("0::/rtfleet.slice/shminfer@ccx0.service\n")
    limit = cgroup_memory_limit(str(root), str(proc_cgroup))
    assert limit == (1 << 30, str(leaf.parent / "memory.max"))
    (leaf / "memory.max").write_text("524288\n")
    assert cgroup_memory_limit(str(root), str(proc_cgroup))[0] == 1 << 19
    proc_cgroup.write_text("12:memory:/rtfleet.slice\n")  # cgroup v1 only: not read
    assert cgroup_memory_limit(str(root), str(proc_cgroup)) is None


def _own_cgroup():
    with open("/proc/self/cgroup", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("0::"):
                return line[3:].strip().lstrip("/")
    pytest.skip("no cgroup v2 hierarchy")
    return None


@pytest.mark.parametrize("level", ["own", "parent"])
def test_queues_bigger_than_the_memory_cgroup_are_refused_in_one_line(tmp_path, level):
    own = _own_cgroup()
    directory = tmp_path / own
    if level == "parent" and own:
        directory = directory.parent
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "memory.max").write_text("1048576\n", encoding="ascii")
    name = f"d{uuid.uuid4().hex[:10]}"
    proc = _serve(name, "--cgroup-root", str(tmp_path))
    try:
        proc.wait(60)
        journal = _journal(proc)
    finally:
        _stop(proc)
    assert proc.returncode == 2, journal
    assert journal.count("\n") == 1 and "memory cgroup" in journal, journal
    assert "1048576" in journal and "Traceback" not in journal, journal
    assert not os.path.exists(registry_path(name))


# ---------------------------------------------------------------- 8: settings together


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--min-batch", "1000", "--max-wait-us", "60000000"), "can never gather"),
        (("--min-batch", "2", "--max-wait-us", "60000000"), "--batch-deadline-s"),
        (("--min-batch", "4", "--max-batch", "2"), "more than --max-batch"),
        (("--min-batch", "2", "--max-wait-us", "6000000"), "--health-stuck-s"),
        (("--health-every-s", "2", "--health-stuck-s", "1"), "--health-stuck-s above it"),
    ],
)
def test_settings_that_cannot_work_together_are_refused_before_start(extra, message):
    name = f"d{uuid.uuid4().hex[:10]}"
    proc = _serve(name, *extra)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"serve {extra} started: {_journal(proc)}") from None
    finally:
        journal = _journal(proc)
        _stop(proc)
    assert proc.returncode == 2, journal
    assert journal.count("\n") == 1 and message in journal and "Traceback" not in journal
    assert not os.path.exists(registry_path(name))


def test_a_rlimit_that_leaves_no_connection_is_refused_before_start():
    name = f"d{uuid.uuid4().hex[:10]}"
    proc = _serve(name, limit_nofile=70)
    try:
        proc.wait(30)
    finally:
        journal = _journal(proc)
        _stop(proc)
    assert proc.returncode == 2 and "LimitNOFILE" in journal and journal.count("\n") == 1


# ---------------------------------------------------------------- 9: smaller


def test_a_fifo_planted_as_the_registry_does_not_hang_a_second_serve():
    with unit() as (name, _proc):
        path = registry_path(name)
        os.unlink(path)
        os.mkfifo(path, 0o600)
        second = _serve(name)
        try:
            second.wait(60)
        except subprocess.TimeoutExpired:
            raise AssertionError("the second serve hangs on the FIFO") from None
        finally:
            journal = _journal(second)
            _stop(second)
        assert second.returncode == 2 and "already running" in journal, journal
        assert _serves(name)


def _slot_back(client, slot):
    lane = client.lanes[0]
    assert lane.seg.state_words[slot] == FREE and slot in lane.free, (slot, lane.free)


def test_payloads_the_reader_refuses_are_refused_at_the_writer_and_free_their_slot():
    with unit() as (name, _proc), _client(name, slots_per_worker=1) as client:
        slot = client.lanes[0].leased[0]
        assert client.infer(_x(1.0), timeout=30)["y"].shape == (1, 2 * WIDTH)  # learned
        raised = bad_payloads(client)
        assert isinstance(raised["structured"], PayloadError), raised
        assert "dtype code '|V8' refused" in str(raised["structured"])
        assert isinstance(raised["70000-arrays"], ValueError), raised
        assert "70000 arrays in one payload" in str(raised["70000-arrays"])
        assert isinstance(raised["int-key"], TypeError), raised
        assert "array names must be str" in str(raised["int-key"])
        lane = client.lanes[0]
        assert lane.seg.state_words[slot] == FREE and slot in lane.free, (slot, lane.free)
        assert np.all(client.infer(_x(2.0), timeout=30)["y"] == 2.0)


def test_topology_entries_with_non_ascii_digits_are_ignored(trees, tmp_path):
    """`node²` and `index²` (str.isdigit takes them) are not nodes or caches."""
    root = tmp_path / "root"
    shutil.copytree(trees("epyc-7702p-nps4"), root, symlinks=True)
    expected = read_topology(str(root))
    (root / "sys/devices/system/node/node²").mkdir()
    (root / "sys/devices/system/cpu/cpu0/cache/index²").mkdir()
    (root / "sys/devices/system/cpu/cpu0/node²").mkdir()
    assert read_topology(str(root)) == expected


def test_a_foreign_clock_does_not_push_the_queue_wait_to_millions_of_ms():
    """Requests whose enqueue stamp is from another clock (another time namespace: here
    boot time 0) record no absurd queue wait, on the Python and (from the second request
    of a layout) the C serve path."""
    with unit() as (name, _proc), _client(name, slots_per_worker=1) as client:
        seg = client.lanes[0].seg
        head = seg.get("ring_head")
        assert [foreign_clock(client, float(i)) for i in range(3)] == [DONE] * 3
        records, _ = seg.ring_read(head)
        waits = records[:, RING_FIELDS.index("queue_wait_ns")]
        assert len(waits) == 3 and waits.max() <= QUEUE_WAIT_MAX_NS, waits / 1e6
        head = seg.get("ring_head")
        assert foreign_clock(client, 4.0, stamp=1 << 63) == DONE  # after the batch's start
        assert seg.ring_read(head)[0][0, RING_FIELDS.index("queue_wait_ns")] == 0
