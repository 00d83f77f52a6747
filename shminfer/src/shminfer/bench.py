"""`shminfer bench ipc`: this runtime against baselines measured in the same run.

Every variant echoes a 16 KiB float32 request into a 32 KiB response between two pinned
processes (client on --client-cpu, server on --server-cpu):

* shminfer     -- this runtime (spin, then futex; zero-copy response views), on its C
                  hot path (shminfer._fast) where it is built
* shminfer_pure -- the same on the pure-Python fallback (SHMINFER_PURE=1 for the worker,
                  shminfer._sys.use("pure") in this client); left out where the C path
                  is not built (then "shminfer" is that fallback)
* pipe_pickle  -- multiprocessing.Pipe + pickle
* tcp_pickle   -- TCP over loopback + pickle, length-prefixed
* sleep_poll   -- the field reports' design: the same SHM slots, 0.5 ms sleep polling
* iceoryx2     -- iceoryx2's Python request/response (when ``import iceoryx2`` works: the
                  optional ``bench`` extra), fixed-size ctypes payloads written in place,
                  both sides busy-polling ``receive()``, the response held (zero-copy) until
                  the next call, as shminfer's ``finish(copy=False)`` views are

The round trips of shminfer, pipe_pickle, tcp_pickle and iceoryx2 are measured
interleaved: all four servers wait side by side (iceoryx2's busy-polling one stopped
with SIGSTOP while it is not its turn) and the requests go in 10 rounds, each a slice of
every variant's in a rotated order. On a VM the host's state moves a variant's p50 by
half from one minute to the next; measured one after another, the ratios of two variants
moved with it (shminfer / iceoryx2 0.22-0.57 in back-to-back runs), interleaved they meet
the same states (docs/dev/shminfer-speed.md). shminfer_pure (this process switches its path)
and sleep_poll (its server polls) run alone afterwards.

For each it prints p50/p99/p99.9/max round trip and sequential throughput, then for
shminfer, pipe_pickle and iceoryx2: throughput with 4 requests in flight, and for
shminfer and pipe_pickle the first request after 1 s idle; with a 1-thread numpy model,
shminfer's deschedule p99. Last, the issue's targets as PASS/FAIL lines, from this run:
shminfer p50 <= 0.5x iceoryx2's, >= 20x faster than Pipe+pickle, >= 100k req/s with 4 in
flight, the first request after 1 s idle faster than Pipe's, and the pure-Python
fallback's p50 <= 20 us where the C path's is <= 12 us.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import struct
import tempfile
import time

import numpy as np

from shminfer.bench_report import print_report, targets

WIDTH = 4096  # float32 -> 16 KiB in, 32 KiB out
VARIANTS = ("shminfer", "shminfer_pure", "pipe_pickle", "tcp_pickle", "sleep_poll", "iceoryx2")


def _pin(cpu):
    if cpu is not None and cpu in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {cpu})


def _stats(samples_ns, elapsed_s):
    us = np.asarray(samples_ns, dtype=np.float64) / 1e3
    return {
        "p50_us": round(float(np.quantile(us, 0.5)), 2),
        "p99_us": round(float(np.quantile(us, 0.99)), 2),
        "p999_us": round(float(np.quantile(us, 0.999)), 2),
        "max_us": round(float(us.max()), 2),
        "rps": round(len(us) / elapsed_s, 1),
        "requests": len(us),
    }


def _sampled(call, requests):
    """``requests`` timed calls: (round trips in ns, the loop's elapsed seconds)."""
    samples = []
    t_start = time.perf_counter()
    for _ in range(requests):
        t0 = time.perf_counter_ns()
        call()
        samples.append(time.perf_counter_ns() - t0)
    return samples, time.perf_counter() - t_start


def _timed(call, requests, warmup=0):
    for _ in range(warmup):
        call()
    return _stats(*_sampled(call, requests))


# ---------------------------------------------------------------- pickle baselines


def _pipe_server(conn, cpu):
    _pin(cpu)
    while True:
        message = conn.recv_bytes()
        if not message:
            return
        x = pickle.loads(message)["x"]
        conn.send_bytes(pickle.dumps({"y": np.concatenate([x, x], axis=-1)}, protocol=5))


def _recv_exact(sock, n):
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("server closed")
        got += k
    return buf


def _tcp_server(port_queue, cpu):
    _pin(cpu)
    listener = socket.create_server(("127.0.0.1", 0))
    port_queue.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        (length,) = struct.unpack("<I", _recv_exact(conn, 4))
        if not length:
            return
        x = pickle.loads(_recv_exact(conn, length))["x"]
        out = pickle.dumps({"y": np.concatenate([x, x], axis=-1)}, protocol=5)
        conn.sendall(struct.pack("<I", len(out)) + out)


class _PipeVariant:
    def __init__(self, ctx, server_cpu):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_pipe_server, args=(child, server_cpu), daemon=True)
        self.proc.start()

    def send(self, inputs):
        self.conn.send_bytes(pickle.dumps(inputs, protocol=5))

    def recv(self):
        return pickle.loads(self.conn.recv_bytes())

    def call(self, inputs):
        self.send(inputs)
        return self.recv()

    def close(self):
        self.conn.send_bytes(b"")
        self.proc.join(5)


class _TcpVariant:
    def __init__(self, ctx, server_cpu):
        ports = ctx.Queue()
        self.proc = ctx.Process(target=_tcp_server, args=(ports, server_cpu), daemon=True)
        self.proc.start()
        self.sock = socket.create_connection(("127.0.0.1", ports.get(timeout=30)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def call(self, inputs):
        data = pickle.dumps(inputs, protocol=5)
        self.sock.sendall(struct.pack("<I", len(data)) + data)
        (length,) = struct.unpack("<I", _recv_exact(self.sock, 4))
        return pickle.loads(_recv_exact(self.sock, length))

    def close(self):
        self.sock.sendall(struct.pack("<I", 0))
        self.sock.close()
        self.proc.join(5)


# ---------------------------------------------------------------- iceoryx2


def iceoryx2_available() -> bool:
    try:
        import iceoryx2  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def _iox_service(iox2, node, name):
    import ctypes  # noqa: PLC0415

    return (
        node.service_builder(iox2.ServiceName.new(name))
        .request_response(ctypes.c_float * WIDTH, ctypes.c_float * (2 * WIDTH))
        .max_active_requests_per_client(8)
        .open_or_create()
    )


def _iox_server(name, cpu, ready):
    import ctypes  # noqa: PLC0415

    import iceoryx2 as iox2  # noqa: PLC0415

    _pin(cpu)
    iox2.set_log_level_from_env_or(iox2.LogLevel.Error)
    node = iox2.NodeBuilder.new().create(iox2.ServiceType.Ipc)
    server = _iox_service(iox2, node, name).server_builder().create()
    ready.set()
    request_type = ctypes.c_char * (4 * WIDTH)
    response_type = ctypes.c_char * (8 * WIDTH)
    while True:
        request = server.receive()
        if request is None:
            continue
        x = np.frombuffer(request_type.from_address(request.payload_ptr), np.float32)
        if np.isnan(x[0]):  # the stop request
            request.delete()
            return
        response = request.loan_uninit()
        y = np.frombuffer(response_type.from_address(response.payload_ptr), np.float32)
        y.reshape(2, WIDTH)[...] = x  # both halves in one assignment, as shminfer's echo
        response.assume_init().send()
        request.delete()


class _IceoryxVariant:
    """iceoryx2 request/response: the client writes the request into loaned shared memory,
    sends, and busy-polls its pending response; the answer stays loaned until the next
    call (zero-copy, like shminfer's ``finish(copy=False)``)."""

    def __init__(self, ctx, server_cpu):
        import ctypes  # noqa: PLC0415

        import iceoryx2 as iox2  # noqa: PLC0415

        self._request_type = ctypes.c_char * (4 * WIDTH)
        self._response_type = ctypes.c_char * (8 * WIDTH)
        name = f"shminfer_bench/iox{os.getpid()}"
        ready = ctx.Event()
        self.proc = ctx.Process(target=_iox_server, args=(name, server_cpu, ready), daemon=True)
        self.proc.start()
        if not ready.wait(60):
            self.proc.kill()
            raise RuntimeError("iceoryx2 bench server did not start")
        iox2.set_log_level_from_env_or(iox2.LogLevel.Error)
        self.node = iox2.NodeBuilder.new().create(iox2.ServiceType.Ipc)
        self.service = _iox_service(iox2, self.node, name)
        self.client = self.service.client_builder().create()
        self._held = []  # responses the caller may still be reading

    def send(self, inputs):
        request = self.client.loan_uninit()
        # One copy into the loaned sample, through a numpy view of it (as the server reads
        # it): x.ctypes.data alone would cost more than the copy.
        view = np.frombuffer(self._request_type.from_address(request.payload_ptr), np.float32)
        view[...] = inputs["x"]
        return request.assume_init().send()

    def recv_from(self, pending):
        while True:
            response = pending.receive()
            if response is not None:
                break
        pending.delete()
        while len(self._held) >= 4:
            self._held.pop(0).delete()
        self._held.append(response)
        y = np.frombuffer(self._response_type.from_address(response.payload_ptr), np.float32)
        return {"y": y.reshape(1, 2 * WIDTH)}

    def call(self, inputs):
        for response in self._held:
            response.delete()
        self._held.clear()
        return self.recv_from(self.send(inputs))

    def close(self):
        for response in self._held:
            response.delete()
        self._held.clear()
        self.send({"x": np.full((1, WIDTH), np.nan, np.float32)}).delete()
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()


class _ShmVariant:
    def __init__(self, server_cpu, *, wait_mode="futex", backend="echo", model=None, name=None):
        from shminfer.client import Client  # noqa: PLC0415
        from shminfer.server import Server  # noqa: PLC0415

        name = name or f"bench{os.getpid()}{wait_mode}{backend}"
        self.server = Server(
            name,
            [server_cpu],
            numa_node=-1,
            backend=backend,
            model=model,
            slots=16,
            request_bytes=WIDTH * 4 + 4096,
            response_bytes=2 * WIDTH * 4 + 4096,
            worker_options={"sched": "off", "wait_mode": wait_mode, "spin_us": 200},
        )
        self.server.start()
        self.client = Client(name, slots_per_worker=8, wait_mode=wait_mode, spin_us=200)
        self.client.wait_ready(120)

    def call(self, inputs):
        return self.client.finish(self.client.start(inputs), copy=False)

    def close(self):
        self.client.close()
        self.server.stop()


def _pure_variant(server_cpu):
    """shminfer on its pure-Python path: the worker (spawned with this environment) and
    this client; main() switches back to the C path afterwards."""
    from shminfer import _sys  # noqa: PLC0415

    os.environ["SHMINFER_PURE"] = "1"
    _sys.use("pure")
    return _ShmVariant(server_cpu, name=f"benchpure{os.getpid()}")


def _in_flight(variant, inputs, requests, depth=4):
    """Throughput with ``depth`` requests outstanding."""
    t0 = time.perf_counter()
    if isinstance(variant, _ShmVariant):
        client = variant.client
        pending = [client.start(inputs) for _ in range(depth)]
        for _ in range(requests - depth):
            client.finish(pending.pop(0), copy=False)
            pending.append(client.start(inputs))
        for p in pending:
            client.finish(p, copy=False)
    elif isinstance(variant, _IceoryxVariant):
        pending = [variant.send(inputs) for _ in range(depth)]
        for _ in range(requests - depth):
            variant.recv_from(pending.pop(0))
            pending.append(variant.send(inputs))
        for p in pending:
            variant.recv_from(p)
    else:
        for _ in range(depth):
            variant.send(inputs)
        for _ in range(requests - depth):
            variant.recv()
            variant.send(inputs)
        for _ in range(depth):
            variant.recv()
    return round(requests / (time.perf_counter() - t0), 1)


def _after_idle(variant, inputs, samples):
    out = []
    for _ in range(samples):
        time.sleep(1.0)
        t0 = time.perf_counter_ns()
        variant.call(inputs)
        out.append(time.perf_counter_ns() - t0)
    return round(float(np.quantile(np.asarray(out) / 1e3, 0.5)), 2)


def _deschedule(server_cpu, client_cpu, requests):
    from shminfer.backends import make_model  # noqa: PLC0415
    from shminfer.metrics import summarize  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        make_model(os.path.join(tmp, "mlp"), inputs=64, hidden=256, outputs=16)
        variant = _ShmVariant(
            server_cpu,
            backend="numpy",
            model=os.path.join(tmp, "mlp.npz"),
            name=f"benchmlp{os.getpid()}",
        )
        _pin(client_cpu)
        try:
            obs = {"obs": np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)}
            lane = variant.client.lanes[0]
            head = lane.seg.get("ring_head")
            for _ in range(requests):
                variant.call(obs)
            summary = summarize(lane.seg.ring_read(head)[0])
        finally:
            variant.close()
    return summary


ROUNDS = 10  # interleaved rounds of the variants that wait side by side


def _start(name, ctx, args, everywhere, inputs):
    """A variant's server, started unpinned (servers pin themselves), checked once."""
    os.sched_setaffinity(0, everywhere)
    if name == "shminfer":
        variant = _ShmVariant(args.server_cpu)
    elif name == "shminfer_pure":
        variant = _pure_variant(args.server_cpu)
    elif name == "sleep_poll":
        variant = _ShmVariant(args.server_cpu, wait_mode="sleep")
    elif name == "pipe_pickle":
        variant = _PipeVariant(ctx, args.server_cpu)
    elif name == "iceoryx2":
        variant = _IceoryxVariant(ctx, args.server_cpu)
    else:
        variant = _TcpVariant(ctx, args.server_cpu)
    _pin(args.client_cpu)
    try:
        out = variant.call(inputs)
        assert np.array_equal(out["y"][:, :WIDTH], inputs["x"]), f"{name}: wrong echo"
    except BaseException:
        variant.close()
        raise
    return variant


def _pause(variant):
    """Stop a busy-polling server (iceoryx2's) while the others are measured."""
    if isinstance(variant, _IceoryxVariant):
        os.kill(variant.proc.pid, signal.SIGSTOP)


def _resume(variant):
    if isinstance(variant, _IceoryxVariant):
        os.kill(variant.proc.pid, signal.SIGCONT)


def _interleaved(variants, inputs, requests):
    """``requests`` timed calls per variant in ROUNDS rounds (fewer when there are fewer
    requests), each after a warm-up, the order rotated every round. Returns
    {name: (samples_ns, elapsed_s)} and, per round, {name: p50 µs}."""
    names = list(variants)
    rounds = min(ROUNDS, requests)
    pooled = {name: [] for name in names}
    elapsed = dict.fromkeys(names, 0.0)
    by_round = []
    for r in range(rounds):
        per_round = requests // rounds + (r < requests % rounds)
        order = names[r % len(names) :] + names[: r % len(names)] if names else []
        medians = {}
        for name in order:
            variant = variants[name]
            _resume(variant)
            try:
                for _ in range(min(100, per_round)):
                    variant.call(inputs)
                samples, seconds = _sampled(lambda v=variant: v.call(inputs), per_round)
                pooled[name].extend(samples)
                elapsed[name] += seconds
                medians[name] = round(float(np.median(samples)) / 1e3, 2)
            finally:
                _pause(variant)
        by_round.append(medians)
    return {n: (pooled[n], max(elapsed[n], 1e-9)) for n in names}, by_round


def _extras(name, variant, inputs, args):
    """Throughput with 4 in flight and the first request after 1 s idle, where measured."""
    requests = args.requests
    if name in ("shminfer", "shminfer_pure", "pipe_pickle"):
        return {
            "rps_4_in_flight": _in_flight(variant, inputs, requests),
            "after_1s_idle_p50_us": _after_idle(variant, inputs, args.idle_samples),
        }
    if name == "iceoryx2":
        return {"rps_4_in_flight": _in_flight(variant, inputs, requests)}
    return {}


@contextlib.contextmanager
def private_run_dir():
    """The bench's servers publish in a temporary directory of their own (SHMINFER_DIR,
    which spawned workers and Ray's workers inherit), unless SHMINFER_DIR is set: a bench
    needs neither root nor /run/shminfer and never meets a deployed unit."""
    if os.environ.get("SHMINFER_DIR"):
        yield os.environ["SHMINFER_DIR"]
        return
    path = tempfile.mkdtemp(prefix="shminfer-bench-")
    os.environ["SHMINFER_DIR"] = path
    try:
        yield path
    finally:
        os.environ.pop("SHMINFER_DIR", None)
        shutil.rmtree(path, ignore_errors=True)


def main(args) -> int:
    with private_run_dir():
        return _main(args)


def _measure_together(together, ctx, args, everywhere, inputs):
    """The variants that wait side by side, measured interleaved: (their results, the
    variants started, the per-round p50s)."""
    results = {}
    started = {}
    try:
        for name in together:
            started[name] = _start(name, ctx, args, everywhere, inputs)
            _pause(started[name])
        _pin(args.client_cpu)
        samples, rounds = _interleaved(started, inputs, args.requests)
        for name, variant in started.items():
            _resume(variant)
            results[name] = _stats(*samples[name])
            results[name].update(_extras(name, variant, inputs, args))
            _pause(variant)
    finally:
        for variant in started.values():
            _resume(variant)
            variant.close()
    return results, started, rounds


def _measure_alone(alone, ctx, args, everywhere, inputs):
    """The variants that run alone (the pure path, the sleep-poll baseline), one after
    another: their results."""
    from shminfer import _sys  # noqa: PLC0415

    results = {}
    for name in alone:
        variant = _start(name, ctx, args, everywhere, inputs)
        _pin(args.client_cpu)
        try:
            requests = args.requests if name != "sleep_poll" else max(200, args.requests // 20)
            for _ in range(min(1000, requests // 10)):
                variant.call(inputs)
            results[name] = _timed(lambda v=variant: v.call(inputs), requests)
            results[name].update(_extras(name, variant, inputs, args))
        finally:
            variant.close()
            if name == "shminfer_pure":
                os.environ.pop("SHMINFER_PURE", None)
                _sys.use("c")
    return results


def _main(args) -> int:
    ctx = multiprocessing.get_context("spawn")
    everywhere = os.sched_getaffinity(0)
    inputs = {"x": np.random.default_rng(0).standard_normal((1, WIDTH)).astype(np.float32)}
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise ValueError(f"unknown variants {unknown}")
    skipped = []
    if "iceoryx2" in names and not iceoryx2_available():
        names.remove("iceoryx2")
        skipped.append("iceoryx2 (not installed: pip install 'shminfer[bench]')")
    from shminfer import _sys  # noqa: PLC0415

    if "shminfer_pure" in names and _sys.use(_sys.IMPLEMENTATION) == "pure":
        names.remove("shminfer_pure")
        skipped.append("shminfer_pure (this process runs pure already: shminfer is the fallback)")
    load_start = round(os.getloadavg()[0], 2)
    path = _sys.IMPLEMENTATION
    # The variants that can wait side by side (their idle servers take no CPU, or are
    # paused) are measured interleaved: ROUNDS rounds, each a slice of every variant's
    # requests in a rotated order, so that each meets the same states of the host (on a
    # VM they change from one minute to the next). The pure path (this process switches
    # its implementation) and the sleep-poll baseline (it polls) run alone afterwards.
    together = [n for n in names if n not in ("shminfer_pure", "sleep_poll")]
    alone = [n for n in names if n in ("shminfer_pure", "sleep_poll")]
    results, started, rounds = _measure_together(together, ctx, args, everywhere, inputs)
    results.update(_measure_alone(alone, ctx, args, everywhere, inputs))
    report = {
        "variants": {name: results[name] for name in names},
        "shminfer_path": path,
        "load_avg_1m_start": load_start,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    if skipped:
        report["skipped"] = skipped
    if len(started) > 1:
        report["interleaved"] = {"variants": list(started), "rounds_p50_us": rounds}
    if "shminfer" in results:
        os.sched_setaffinity(0, everywhere)
        summary = _deschedule(args.server_cpu, args.client_cpu, min(args.requests, 5000))
        report["deschedule_1thread_model"] = {
            "p50_ms": round(summary["deschedule_ms_p50"], 4),
            "p99_ms": round(summary["deschedule_ms_p99"], 4),
            "p999_ms": round(summary["deschedule_ms_p999"], 4),
            "cpu_ratio": round(summary["cpu_ratio"], 3) if summary["cpu_ratio"] else None,
        }
        base = results["shminfer"]["p50_us"]
        report["ratios_vs_shminfer_p50"] = {
            n: round(r["p50_us"] / base, 2) for n, r in results.items() if n != "shminfer"
        }
        report["targets"] = targets(results)
    if args.format == "json":
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0
