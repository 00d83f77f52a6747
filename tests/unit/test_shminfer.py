"""shminfer: codec, queue semantics, backends, faults and bad input — on real processes and
real shared memory (no mocks). Timing targets live in `shminfer bench ipc`, not here."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from shminfer_serving import CPUS, serving

from shminfer import _sys
from shminfer.backends import BackendError, make_backend, make_model
from shminfer.client import Client, InferenceError
from shminfer.codec import Decoder, Encoder, PayloadError
from shminfer.queue import FREE, PROCESSING, QueueError
from shminfer.registry import (
    atomic_write,
    make_unit_dir,
    registry_path,
    segment_name,
    socket_path,
    unit_dir,
)
from shminfer.server import Server


def _x(value, rows=1, width=4096):
    return {"x": np.full((rows, width), value, dtype=np.float32)}


# ---------------------------------------------------------------- codec


@pytest.mark.parametrize(
    "arrays",
    [
        {"a": np.arange(12, dtype=np.float32).reshape(3, 4)},
        {"a": np.zeros((0, 5), np.int64), "b": np.array(7, np.uint8)},
        {
            "obs": np.ones((2, 3, 4), np.float16),
            "mask": np.array([[True, False]]),
            "ids": np.arange(5, dtype=">i4"),
        },
    ],
)
def test_codec_round_trip_is_in_place(arrays):
    buf = memoryview(bytearray(8192))
    length = Encoder().encode_into(buf, arrays)
    out = Decoder().decode(buf, length)
    assert list(out) == list(arrays)
    for name, value in arrays.items():
        assert out[name].dtype == value.dtype
        np.testing.assert_array_equal(out[name], value)
        if out[name].nbytes:
            assert out[name].base is not None  # a view into the buffer, not a copy


def test_codec_rejects_what_does_not_fit_or_is_garbage():
    with pytest.raises(PayloadError, match="does not fit a 1024-byte slot"):
        Encoder().encode_into(memoryview(bytearray(1024)), {"x": np.zeros(1024, np.float32)})
    with pytest.raises(PayloadError, match="object arrays"):
        Encoder().encode_into(memoryview(bytearray(1024)), {"x": np.array([object()])})
    buf = memoryview(bytearray(4096))
    length = Encoder().encode_into(buf, {"x": np.zeros(8, np.float32)})
    corrupt = bytearray(buf)
    corrupt[4 + 2 + 1 + 1 + 1 + 3] = ord("O")  # dtype '<f4' -> 'Of4'
    with pytest.raises(PayloadError):
        Decoder().decode(memoryview(corrupt), length)
    with pytest.raises(PayloadError, match="outside the slot"):
        Decoder().decode(buf, 10**6)
    random_bytes = memoryview(bytearray(np.random.default_rng(3).bytes(4096)))
    with pytest.raises(PayloadError):
        Decoder().decode(random_bytes, 4096)


# ---------------------------------------------------------------- queue semantics


def test_sync_async_and_round_robin_over_workers():
    cpus = CPUS[:2] if len(CPUS) > 1 else CPUS * 1
    with serving(cpus=cpus) as server, Client(server.name, slots_per_worker=4) as client:
        client.wait_ready(60)
        out = client.infer(_x(1.5))
        assert out["y"].shape == (1, 8192)
        assert np.all(out["y"] == 1.5)
        pending = [client.start(_x(float(i), rows=2)) for i in range(8)]
        assert {p.worker for p in pending} == set(range(len(cpus)))
        for i, p in enumerate(reversed(pending)):
            value = float(7 - i)
            assert np.all(client.finish(p)["y"] == value)
        with pytest.raises(QueueError, match="no free slot"):
            for _ in range(100):
                client.start(_x(0.0))


def test_numpy_and_openvino_backends_agree(tmp_path):
    pytest.importorskip("openvino")
    make_model(str(tmp_path / "mlp"), inputs=16, hidden=32, outputs=4)
    obs = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    results = {}
    for backend, suffix in (("numpy", ".npz"), ("openvino", ".xml")):
        with (
            serving(backend=backend, model=str(tmp_path / f"mlp{suffix}")) as server,
            Client(server.name) as client,
        ):
            client.wait_ready(120)
            assert client.model["inputs"]["obs"]["shape"][1] == 16
            results[backend] = client.infer({"obs": obs})["logits"]
    np.testing.assert_allclose(results["numpy"], results["openvino"], rtol=1e-4, atol=1e-5)


def test_openvino_runs_one_inference_thread(tmp_path):
    pytest.importorskip("openvino")
    make_model(str(tmp_path / "mlp"), inputs=8, hidden=8, outputs=2)
    backend = make_backend("openvino")
    backend.load(str(tmp_path / "mlp.xml"), threads=1)
    assert backend.threads == 1
    with pytest.raises(BackendError, match="inputs"):
        backend.infer({"nope": np.zeros((1, 8), np.float32)})


def test_backends_write_into_the_response_slot_what_infer_returns(tmp_path):
    # Backend.infer_into: given the slot's arrays of the right layout, the backend fills
    # them and hands them back; anything else, it returns what infer does.
    make_model(str(tmp_path / "mlp"), inputs=16, hidden=32, outputs=4)
    mlp = make_backend("numpy")
    mlp.load(str(tmp_path / "mlp.npz"))
    echo = make_backend("echo")
    echo.load(None)
    obs = {"obs": np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)}
    for backend, inputs in ((mlp, obs), (echo, _x(2.5, rows=3, width=5))):
        want = backend.infer(inputs)
        buf = memoryview(bytearray(4096))
        encoder = Encoder()
        assert encoder.out_views(buf, 0) is None
        encoder.encode_into(buf, {k: np.zeros_like(v) for k, v in want.items()}, slot=0)
        out = encoder.out_views(buf, 0)
        assert backend.infer_into(inputs, out) is out
        length = encoder.encode_in_place(buf, out, 0)
        got = Decoder().decode(buf, length)
        assert list(got) == list(want)
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value)  # bit for bit, not close
        # Another batch size: not the slot's layout, so fresh arrays, not the slot's.
        smaller = {k: v[:1] for k, v in inputs.items()}
        other = backend.infer_into(smaller, out)
        assert other is not out
        name = next(iter(want))
        np.testing.assert_array_equal(other[name], backend.infer(smaller)[name])
    with pytest.raises(PayloadError, match="not this slot's"):
        Encoder().encode_in_place(memoryview(bytearray(64)), {}, 0)


def test_answers_written_in_place_follow_the_request_and_rewrite_a_scribbled_header():
    with serving(slots=1) as server, Client(server.name, slots_per_worker=1) as client:
        client.wait_ready(60)
        lane = client.lanes[0]
        (slot,) = lane.leased
        for i, (rows, width) in enumerate(
            ((1, 4096), (1, 4096), (2, 2048), (1, 8), (1, 8), (1, 4096))
        ):
            if i == 4:
                # The client's own response slot, scribbled between two answers.
                lane.responses[slot][:256] = b"\xee" * 256
            x = np.random.default_rng(i).standard_normal((rows, width)).astype(np.float32)
            y = client.infer({"x": x})["y"]
            np.testing.assert_array_equal(y, np.concatenate([x, x], axis=-1))


def test_a_backend_that_gains_nothing_from_merging_is_served_one_request_at_a_time():
    # Echo declares merge = False: several READY requests are answered one by one (each in
    # place), never concatenated into one call and copied apart again.
    with serving() as server, Client(server.name, slots_per_worker=8) as client:
        client.wait_ready(60)
        seg = client.lanes[0].seg
        head = seg.get("ring_head")
        for _ in range(20):
            pending = [client.start(_x(float(i), rows=1 + i % 2)) for i in range(6)]
            for i, p in enumerate(pending):
                assert np.all(client.finish(p)["y"] == float(i))
        records = seg.ring_read(head)[0]
        assert records.shape[0] == 120
        assert set(records[:, 5]) == {1.0, 2.0}  # each batch one request's rows


def test_bad_requests_get_an_error_and_the_worker_keeps_serving():
    with serving() as server, Client(server.name) as client:
        client.wait_ready(60)
        with pytest.raises(InferenceError, match="input 'x' missing"):
            client.infer({"wrong": np.zeros((1, 4), np.float32)})
        with pytest.raises(InferenceError, match="disagree on the batch size"):
            client.infer({"x": np.zeros((2, 4), np.float32), "y": np.zeros((3, 4), np.float32)})
        with pytest.raises(PayloadError, match="--request-bytes"):
            client.infer(_x(0.0, rows=64))  # 1 MiB: refused before anything is sent
        # A buggy client writing garbage straight into its slot.
        lane = client.lanes[0]
        slot = lane.free[-1]
        view = lane.requests[slot]
        view[:64] = b"\xff" * 64
        lane.seg.slot_set(slot, "request_len", 64)
        lane.seg.states[slot] = 2  # READY
        lane.seg.ring_doorbell()
        deadline = time.monotonic() + 5
        while int(lane.seg.states[slot]) != 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        message = bytes(lane.responses[slot][: lane.seg.slot_get(slot, "response_len")])
        assert b"bad request" in message
        lane.seg.states[slot] = FREE
        assert np.all(client.infer(_x(3.0))["y"] == 3.0)


def test_timeout_then_the_slot_comes_back():
    with (
        serving(backend="burn", model="300") as server,
        Client(server.name, slots_per_worker=1) as client,
    ):
        client.wait_ready(60)
        pending = client.start(_x(1.0))
        with pytest.raises(TimeoutError, match="no answer in time"):
            client.finish(pending, timeout=0.05)
        # The only slot is abandoned until the worker answers the late request ...
        with pytest.raises(QueueError, match="no free slot"):
            client.start(_x(0.0))
        lane = client.lanes[0]
        deadline = time.monotonic() + 30
        while lane.seg.state_words[pending.slot] != 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        # ... then it is reclaimed and serves again.
        assert np.all(client.infer(_x(2.0), timeout=5)["y"] == 2.0)


# ---------------------------------------------------------------- faults


def test_worker_killed_mid_batch_clients_get_errors_and_a_new_worker_serves():
    with serving(backend="burn", model="2000") as server, Client(server.name, timeout=10) as client:
        client.wait_ready(60)
        lane = client.lanes[0]
        pending = [client.start(_x(float(i))) for i in range(3)]
        deadline = time.monotonic() + 5
        while not (lane.seg.states == PROCESSING).any() and time.monotonic() < deadline:
            time.sleep(0.005)
        old_pid = lane.seg.get("worker_pid")
        os.kill(old_pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(InferenceError, match="died"):
            client.finish(pending[0])
        assert time.monotonic() - t0 < 10
        # The others were READY, not claimed: the restarted worker serves them.
        for i, p in enumerate(pending[1:], start=1):
            try:
                assert np.all(client.finish(p, timeout=40)["y"] == float(i))
            except InferenceError as exc:
                assert "died" in str(exc)
        client.wait_ready(60)
        assert lane.seg.get("worker_pid") != old_pid
        assert server.restarts[server.cpus[0]] >= 1


_DYING_CLIENT = """
import os, sys, numpy as np
from shminfer.client import Client
c = Client(sys.argv[1], slots_per_worker=int(sys.argv[2]))
c.start({"x": np.zeros((1, 16), np.float32)})
print("leased", flush=True)
os.kill(os.getpid(), 9)
"""


def test_a_killed_client_loses_its_slots_to_the_server():
    with serving() as server:
        seg = server.segments[server.cpus[0]]
        proc = subprocess.run(
            [sys.executable, "-c", _DYING_CLIENT, server.name, "32"],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        assert "leased" in proc.stdout and proc.returncode == -9
        deadline = time.monotonic() + 5
        while seg.owners.any() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not seg.owners.any()
        with Client(server.name, slots_per_worker=32) as client:
            assert len(client.lanes[0].free) == 32
            assert np.all(client.infer(_x(4.0))["y"] == 4.0)


def test_stale_files_from_a_crash_are_removed_and_a_live_server_is_not_clobbered():
    name = f"t{uuid.uuid4().hex[:10]}"
    make_unit_dir(name)
    with open(registry_path(name), "w") as handle:  # a supervisor that died
        json.dump({"pid": 999999, "pid_start": 1, "workers": []}, handle)
    with open(socket_path(name), "w"):  # and the socket it left (here a plain file)
        pass
    with serving(name=name) as server, Client(name) as client:
        client.wait_ready(60)
        assert stat.S_ISSOCK(os.lstat(socket_path(name)).st_mode)
        with pytest.raises(QueueError, match="already running"):
            Server(name, server.cpus, numa_node=-1).start()
        assert np.all(client.infer(_x(5.0))["y"] == 5.0)


def test_segments_are_private_to_their_user():
    with serving() as server:
        # The segments are sealed memfds handed over the socket: the socket is the door.
        assert stat.S_IMODE(os.stat(unit_dir(server.name)).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(socket_path(server.name)).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(registry_path(server.name)).st_mode) == 0o600
        if os.geteuid() != 0:
            pytest.skip("needs root to try as another user")
        code = (
            "import os\n"
            "from shminfer.client import Client\n"
            "from shminfer.queue import QueueError\n"
            "os.setgid(65534); os.setuid(65534)\n"
            f"try:\n    Client({server.name!r})\n"
            "except QueueError as e:\n    print(e)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60
        )
        assert "permission denied" in out.stdout, out.stdout + out.stderr


def test_queue_memory_is_bound_to_the_numa_node():
    """numa_maps of a worker shows the segment with the bind policy on its node."""
    if not os.path.exists("/proc/self/numa_maps"):
        pytest.skip("kernel without NUMA support")
    name = f"t{uuid.uuid4().hex[:10]}"
    server = Server(name, CPUS[-1:], numa_node=0, backend="echo", worker_options={"sched": "off"})
    server.start()
    try:
        with Client(name) as client:
            client.wait_ready(60)
            client.infer(_x(1.0))
            pid = client.lanes[0].seg.get("worker_pid")
            with open(f"/proc/{pid}/numa_maps") as handle:
                maps = handle.read()
        line = next(ln for ln in maps.splitlines() if segment_name(name, CPUS[-1]) in ln)
        assert "bind:0" in line
        assert "N0=" in line
    finally:
        server.stop()


_SOAK_CLIENT = """
import json, sys, time, numpy as np
from shminfer.client import Client, InferenceError
name, n, tag = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
seen = {}
with Client(name, timeout=10, slots_per_worker=4) as c:
    c.wait_ready(60)
    pending = []
    for seq in range(n):
        x = np.full((1, 64), tag * 1_000_000 + seq, dtype=np.float64)
        pending.append((seq, c.start({"x": x})))
        if len(pending) == 4 or seq == n - 1:
            for s, p in pending:
                try:
                    y = c.finish(p)["y"]
                    ok = bool(np.all(y == tag * 1_000_000 + s)) and y.shape == (1, 128)
                    seen[s] = seen.get(s, []) + ["ok" if ok else "WRONG"]
                except (InferenceError, TimeoutError) as e:
                    seen[s] = seen.get(s, []) + ["error"]
            pending = []
print(json.dumps(seen))
"""


def test_soak_with_random_worker_kills_every_request_answered_exactly_once():
    rng = np.random.default_rng(7)
    with serving(cpus=CPUS[:2] if len(CPUS) > 1 else CPUS, backend="burn", model="0.2") as server:
        clients = [
            subprocess.Popen(
                [sys.executable, "-c", _SOAK_CLIENT, server.name, "600", str(t)],
                stdout=subprocess.PIPE,
                text=True,
            )
            for t in (1, 2)
        ]
        kills = 0
        while any(c.poll() is None for c in clients) and kills < 6:
            time.sleep(float(rng.uniform(0.2, 0.6)))
            seg = server.segments[server.cpus[int(rng.integers(len(server.cpus)))]]
            pid = seg.get("worker_pid")
            if pid and _sys.process_start_time(pid) is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    kills += 1
        results = [json.loads(c.communicate(timeout=120)[0]) for c in clients]
    assert kills >= 1
    for seen in results:
        assert sorted(int(k) for k in seen) == list(range(600))
        outcomes = [v for values in seen.values() for v in values]
        assert all(len(v) == 1 for v in seen.values()), "a request was answered twice"
        assert "WRONG" not in outcomes, "a response belonged to another request"
        assert outcomes.count("ok") > 300


def _cli(*args, **kwargs):
    return [sys.executable, "-m", "shminfer.cli", *args]


def test_cli_serve_smoke_stats_metrics_and_clean_sigterm(tmp_path):
    import urllib.request

    name = f"t{uuid.uuid4().hex[:10]}"
    assert subprocess.run(_cli("make-model", str(tmp_path / "mlp")), check=False).returncode == 0
    serve = subprocess.Popen(
        _cli(
            "serve",
            "--name",
            name,
            "--cpus",
            str(CPUS[-1]),
            "--numa-node",
            "-1",
            "--backend",
            "numpy",
            "--model",
            str(tmp_path / "mlp.npz"),
            "--sched",
            "off",
            "--metrics-port",
            "0",
            "--metrics-textfile",
            str(tmp_path / "shminfer.prom"),
            "--metrics-every-s",
            "0.5",
        ),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        smoke = subprocess.run(
            _cli(
                "smoke",
                "--name",
                name,
                "-n",
                "300",
                "--format",
                "json",
                "--max-p99-ms",
                "1000",
                "--max-deschedule-p999-ms",
                "1000",
            ),
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        assert smoke.returncode == 0, smoke.stderr
        result = json.loads(smoke.stdout)
        assert result["passed"] and result["errors"] == 0 and result["batches"] >= 300
        assert 0.8 < result["cpu_ratio"] < 1.25
        # jitter = std / mean of the round trips: a positive number on any real run
        assert isinstance(result["latency_jitter"], float) and result["latency_jitter"] > 0
        probe = subprocess.run(
            _cli("probe", "--name", name), capture_output=True, text=True, check=False, timeout=60
        )
        assert probe.returncode == 0, probe.stderr
        answer = json.loads(probe.stdout)
        assert answer["ready"] and answer["worker_cpus"] == [CPUS[-1]] and answer["pid"] > 0
        assert len(answer["latency_ms"]) == 1
        # A gate that cannot pass fails the smoke test with a reason.
        strict = subprocess.run(
            _cli("smoke", "--name", name, "-n", "50", "--max-p99-ms", "0.000001"),
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        assert strict.returncode == 1 and "latency p99" in strict.stdout
        jittery = subprocess.run(
            _cli("smoke", "--name", name, "-n", "50", "--max-jitter", "0", "--format", "json"),
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        assert jittery.returncode == 1, jittery.stderr
        assert any(
            f.startswith("round-trip jitter (std/mean) ")
            for f in json.loads(jittery.stdout)["failures"]
        )
        stats = subprocess.run(
            _cli("stats", "--name", name, "--format", "prometheus"),
            capture_output=True,
            text=True,
            check=True,
        )
        assert 'shminfer_deschedule_ms{server="%s"' % name in stats.stdout
        port = None
        deadline = time.monotonic() + 30
        while port is None and time.monotonic() < deadline:
            line = serve.stderr.readline()
            if '"metrics_listening"' in line:
                port = int(json.loads(line)["address"].rsplit(":", 1)[1])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert b"shminfer_worker_restarts_total" in resp.read()
        # The node_exporter textfile: rewritten every 0.5 s, valid exposition text that
        # Prometheus' own parser reads, world-readable, with the smoke's batches in it.
        textfile = tmp_path / "shminfer.prom"
        first = textfile.stat().st_mtime_ns
        deadline = time.monotonic() + 30
        while textfile.stat().st_mtime_ns == first and time.monotonic() < deadline:
            time.sleep(0.1)
        assert textfile.stat().st_mtime_ns != first, "the textfile was not rewritten"
        assert textfile.stat().st_mode & 0o777 == 0o644
        samples = {
            (sample.name, sample.labels.get("quantile")): sample.value
            for family in text_string_to_metric_families(textfile.read_text())
            for sample in family.samples
            if sample.labels.get("server") == name
        }
        assert samples[("shminfer_workers_ready", None)] == 1.0
        assert samples[("shminfer_workers", None)] == 1.0
        assert samples[("shminfer_batches", None)] >= 300
        assert samples[("shminfer_slow_infer_batches", None)] == 0
        assert ("shminfer_deschedule_ms", "0.999") in samples
        assert abs(samples[("shminfer_metrics_updated_timestamp_seconds", None)] - time.time()) < 30
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(30) == 0
    assert not (tmp_path / "shminfer.prom").exists(), "a stopped server left its metrics"
    assert not os.path.exists(registry_path(name))
    assert not os.path.exists(socket_path(name))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("serve", "--name", "x/../y", "--cpus", "0", "--backend", "echo"), "must be 1-64 letters"),
        (("serve", "--name", "ok", "--cpus", "9999", "--backend", "echo"), "outside this process"),
        (("smoke", "--name", "nobody-runs-this", "--ready-timeout", "0.2"), "no shminfer server"),
    ],
)
def test_cli_refuses_bad_input_with_one_line(args, message):
    if args[0] == "serve":
        args = (*args, "--numa-node", "-1")
    bad = subprocess.run(_cli(*args), capture_output=True, text=True, check=False)
    assert bad.returncode == 2
    assert message in bad.stderr
    assert "Traceback" not in bad.stderr


def test_serve_binds_memory_of_a_memoryless_node_to_the_nearest_node(trees):
    """Without --numa-node, serve binds its segments to the CPUs' node, or, on a socket
    without DIMMs, to the node its memory comes from (never to a node with no memory)."""
    from rtfleet.topology import read_topology
    from shminfer.cli import _node_of

    root = str(trees("xeon-2s-memoryless-node0"))
    topology = read_topology(root)
    memoryless = next(n for n in topology["numa_nodes"] if not n["has_memory"] and n["cpus"])
    with_memory = next(n for n in topology["numa_nodes"] if n["has_memory"] and n["cpus"])
    assert _node_of(memoryless["cpus"][:2], root) == memoryless["memory_node"] != memoryless["id"]
    assert _node_of(with_memory["cpus"][:2], root) == with_memory["id"]


def test_atomic_write_never_follows_a_planted_link(tmp_path):
    """The metrics textfile and the registry are written the same way: a link planted at
    the path (or a victim file behind it) is replaced, never written through."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "shminfer.prom"
    target.symlink_to(victim)
    atomic_write(str(target), "shminfer_workers 1\n", 0o644)
    assert victim.read_text() == "precious"
    assert not target.is_symlink() and target.read_text() == "shminfer_workers 1\n"
    assert target.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shminfer.prom", "victim"]
