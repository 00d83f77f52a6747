"""``shminfer bench ray``: a sampler's round trip through a Ray actor against shminfer direct.

The field reports' samplers called an inference Ray actor: every observation went through
Ray's object store and gRPC to the actor's method, and back. shminfer keeps the actor for
placement and lifetime (``shminfer.ray_actor``) but takes the per-request path out of Ray.
This measures, in one run, on this machine, with the same 16 KiB in / 32 KiB out echo:

- ``ray_actor``: ``ray.get(actor.infer.remote(obs))``, an echo computed in the actor (the
  field reports' design; their anchor: ~1.1 ms a call);
- ``ray_actor_shminfer``: the same call, the actor answering through a shminfer client of
  a pinned unit (a Ray sampler that keeps its actor API);
- ``shminfer``: the sampler's own ``Client.infer`` of that unit, no Ray in the path;

and prints each one's percentiles and the ratio of the Ray actor call to the direct one.
Nothing here is asserted in a test; the figures depend on the machine and its load.
"""

from __future__ import annotations

import json
import os

import numpy as np

from shminfer.bench import WIDTH, _pin, _timed
from shminfer.queue import QueueError


def _ray():
    # One node, on loopback only (Ray otherwise binds its services to the interface
    # address), and no usage report; set before Ray is imported.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray  # noqa: PLC0415
    except ImportError:
        raise QueueError("shminfer bench ray needs Ray: pip install 'shminfer[ray]'") from None
    return ray


class EchoActorImpl:
    """The field reports' design: inference inside the actor's method."""

    def infer(self, inputs):
        x = inputs["x"]
        return {"y": np.concatenate([x, x], axis=-1)}


class ShminferActorImpl:
    """A Ray actor that answers through a shminfer client of a pinned unit."""

    def __init__(self, name):
        from shminfer.client import Client  # noqa: PLC0415

        self.client = Client(name, timeout=30)
        self.client.wait_ready(120)

    def infer(self, inputs):
        return self.client.infer(inputs)


def main(args) -> int:
    from shminfer.bench import private_run_dir  # noqa: PLC0415

    with private_run_dir():  # before ray.init: its workers inherit it
        return _main(args)


def _main(args) -> int:
    ray = _ray()
    from shminfer.bench import _ShmVariant  # noqa: PLC0415

    inputs = {"x": np.random.default_rng(0).standard_normal((1, WIDTH)).astype(np.float32)}
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(
            num_cpus=max(2, os.cpu_count() or 2),
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=128 << 20,
        )
    load_start = round(os.getloadavg()[0], 2)
    unit = _ShmVariant(args.server_cpu, name=f"benchray{os.getpid()}")
    results = {}
    try:
        echo = ray.remote(num_cpus=0)(EchoActorImpl).remote()
        via = ray.remote(num_cpus=0)(ShminferActorImpl).remote(unit.server.name)
        warmup = max(10, args.requests // 20)
        _pin(args.client_cpu)  # as bench ipc: the sampler on one CPU, the unit on another
        results["ray_actor"] = _timed(
            lambda: ray.get(echo.infer.remote(inputs)), args.requests, warmup
        )
        results["ray_actor_shminfer"] = _timed(
            lambda: ray.get(via.infer.remote(inputs)), args.requests, warmup
        )
        results["shminfer"] = _timed(lambda: unit.client.infer(inputs), args.requests, warmup)
        for actor in (echo, via):
            ray.kill(actor)
    finally:
        unit.close()
        if started_ray:
            ray.shutdown()
    direct = results["shminfer"]["p50_us"]
    report = {
        "bench": "ray",
        "ray": ray.__version__,
        "requests": args.requests,
        "bytes_in": WIDTH * 4,
        "bytes_out": 2 * WIDTH * 4,
        "results": results,
        "ray_actor_over_shminfer_p50": round(results["ray_actor"]["p50_us"] / direct, 1),
        "load": {"start": load_start, "end": round(os.getloadavg()[0], 2)},
    }
    if args.format == "json":
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"shminfer bench ray: Ray {report['ray']}, {args.requests} requests each, "
        f"16 KiB in / 32 KiB out, load {report['load']['start']} -> {report['load']['end']}"
    )
    print(f"{'path':<22}{'p50 us':>10}{'p99 us':>10}{'p99.9 us':>10}{'req/s':>10}")
    for name, row in results.items():
        print(
            f"{name:<22}{row['p50_us']:>10.1f}{row['p99_us']:>10.1f}{row['p999_us']:>10.1f}"
            f"{row['rps']:>10.0f}"
        )
    print(
        f"a Ray actor call takes {report['ray_actor_over_shminfer_p50']}x shminfer's direct "
        "round trip (p50)"
    )
    return 0
