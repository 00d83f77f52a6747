"""shminfer: shared-memory inference runtime — serve, probe, smoke, stats, bench, make-model."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from shminfer import cli_options
from shminfer.backends import BackendError, make_model
from shminfer.client import Client, InferenceError, attach
from shminfer.codec import PayloadError
from shminfer.metrics import slow_batches, summarize
from shminfer.queue import CPU_EXACT_NS, QueueError
from shminfer.registry import read_registry


def _node_of(cpus: list[int], root: str = "/") -> int:
    """The memory node for ``cpus``: the NUMA node they all sit on, or, when that node has
    no memory (a socket without DIMMs), the nearest node with memory (rtfleet's topology
    reader says which)."""
    from shminfer.topology import read_topology  # noqa: PLC0415

    topology = read_topology(root)
    nodes = {n["id"]: n for n in topology["numa_nodes"] if set(cpus) & set(n["cpus"])}
    if len(nodes) != 1:
        raise QueueError(
            f"CPUs {cpus} span NUMA nodes {sorted(nodes)}: run one server per node "
            "(one per CCX), or pass --numa-node explicitly"
        )
    node = nodes.popitem()[1]
    memory_node = node.get("memory_node")
    return node["id"] if memory_node is None else memory_node


def cmd_serve(args) -> int:
    from shminfer.server import Server, run_server  # noqa: PLC0415

    numa_node = _node_of(args.cpus) if args.numa_node is None else args.numa_node
    server = Server(
        args.name,
        args.cpus,
        numa_node=numa_node,
        backend=args.backend,
        model=args.model,
        slots=args.slots,
        request_bytes=args.request_bytes,
        response_bytes=args.response_bytes,
        group=args.group,
        batch_deadline_s=args.batch_deadline_s,
        health=(args.health_every_s, args.health_stuck_s, args.health_grace_s),
        cgroup_root=args.cgroup_root,
        worker_options={
            "threads": 1,
            "min_batch": args.min_batch,
            "max_batch": args.max_batch,
            "max_wait_us": args.max_wait_us,
            "spin_us": args.spin_us,
            "sched": args.sched,
            "rt_priority": args.rt_priority,
            "slow_cpu_ms": args.slow_cpu_ms,
            "slow_wall_ms": args.slow_wall_ms,
        },
    )
    return run_server(
        server,
        metrics_port=args.metrics_port,
        metrics_textfile=args.metrics_textfile,
        metrics_every_s=args.metrics_every_s,
    )


def _inputs_for(model: dict, batch: int, rng) -> dict:
    inputs = {}
    for name, spec in model["inputs"].items():
        shape = [batch if d in (-1, None) else d for d in spec["shape"]]
        shape[0] = batch
        inputs[name] = rng.standard_normal(shape).astype(spec.get("dtype", "float32"))
    return inputs


def _connect(args) -> Client:
    """A client, waiting up to --ready-timeout for the server to come up."""
    deadline = time.monotonic() + args.ready_timeout
    while True:
        try:
            return Client(args.name, timeout=args.timeout)
        except QueueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def cmd_smoke(args) -> int:
    if args.max_deschedule_p999_ms < CPU_EXACT_NS / 1e6:
        # Below it, a short batch's deschedule is an upper bound (its wall time), not exact.
        print(
            f"shminfer smoke: --max-deschedule-p999-ms must be at least {CPU_EXACT_NS / 1e6} "
            "(the worker measures CPU time exactly for batches of 0.1 ms or more)",
            file=sys.stderr,
        )
        return 2
    rng = np.random.default_rng(0)
    choice = None
    if not args.name:  # a sampler: the unit nearest to its CPUs
        from shminfer.locality import where  # noqa: PLC0415

        choice = where(match=args.match)
        args.name = choice.name
    latencies, errors, records, affinity = _smoke_requests(args, rng)
    summary = summarize(records)
    result = _smoke_result(
        args,
        choice,
        summary,
        latencies=latencies,
        errors=errors,
        records=records,
        affinity=affinity,
    )
    failures = _smoke_failures(args, result, summary, errors=errors, affinity=affinity)
    result["passed"] = not failures
    result["failures"] = failures
    if args.format == "json":
        print(json.dumps(result, indent=2))
    else:
        _print_smoke(result)
    return 0 if not failures else 1


def _smoke_requests(args, rng):
    """The warm-up and the measured requests: (round trips in ms, errors, the ring records
    of the measured window, this client's CPU affinity before and after)."""
    with _connect(args) as client:
        client.wait_ready(args.ready_timeout)
        model = client.model
        latencies = []
        errors = 0
        for _ in range(args.warmup):
            client.infer(_inputs_for(model, args.batch, rng))
        # Metrics window: the batches after the warm-up.
        heads = [lane.seg.get("ring_head") for lane in client.lanes]
        requests = [_inputs_for(model, args.batch, rng) for _ in range(min(args.requests, 64))]
        # Where this client ran: its CPU affinity as the kernel holds it (what systemd-run's
        # CPUAffinity=/AllowedCPUs=, taskset or a container's cpuset left it), read before
        # and after the measured requests, not the CPU a caller meant to give it.
        affinity_before = os.sched_getaffinity(0)
        for i in range(args.requests):
            t0 = time.perf_counter_ns()
            try:
                client.infer(requests[i % len(requests)])
            except (InferenceError, TimeoutError) as exc:
                errors += 1
                print(f"request {i}: {exc}", file=sys.stderr)
                continue
            latencies.append((time.perf_counter_ns() - t0) / 1e6)
        affinity_after = os.sched_getaffinity(0)
        records = np.concatenate(
            [lane.seg.ring_read(since)[0] for lane, since in zip(client.lanes, heads)]
        )
    return latencies, errors, records, (affinity_before, affinity_after)


def _smoke_result(args, choice, summary, *, latencies, errors, records, affinity):
    """`shminfer smoke`'s result, before its verdict."""
    from shminfer.cpulist import format_cpulist  # noqa: PLC0415

    affinity_before, affinity_after = affinity
    lat = np.array(latencies) if latencies else np.array([np.nan])
    return {
        "server": args.name,
        **({"choice": choice.as_dict()} if choice else {}),
        "requests": args.requests,
        "errors": errors,
        "latency_ms_p50": float(np.quantile(lat, 0.5)),
        "latency_ms_p99": float(np.quantile(lat, 0.99)),
        "latency_ms_p999": float(np.quantile(lat, 0.999)),
        "latency_ms_max": float(lat.max()),
        # Jitter coefficient of the round trip: standard deviation / mean (the field
        # reports watch 0.20); None without two answers.
        "latency_jitter": float(lat.std() / lat.mean())
        if lat.size > 1 and lat.mean() > 0
        else None,
        "slow_infer": slow_batches(records, args.slow_cpu_ms, args.slow_wall_ms),
        # The client's CPUs as it ran (sched_getaffinity): every CPU it was allowed on
        # during the measured requests.
        "client_cpus": format_cpulist(affinity_before | affinity_after),
        **{k: v for k, v in summary.items() if k != "samples"},
    }


def _smoke_failures(args, result, summary, *, errors, affinity):
    """The gates `shminfer smoke` failed, one line each."""
    from shminfer.cpulist import format_cpulist  # noqa: PLC0415

    affinity_before, affinity_after = affinity
    failures = []
    if affinity_after != affinity_before:
        failures.append(
            f"the client's CPU affinity changed during the run (CPUs "
            f"{format_cpulist(affinity_before)}, then {format_cpulist(affinity_after)})"
        )
    if errors > args.max_errors:
        failures.append(f"{errors} errors > {args.max_errors}")
    if result["latency_ms_p99"] > args.max_p99_ms:
        failures.append(f"latency p99 {result['latency_ms_p99']:.3f} ms > {args.max_p99_ms} ms")
    if summary.get("deschedule_ms_p999", 0.0) > args.max_deschedule_p999_ms:
        failures.append(
            f"deschedule p99.9 {summary['deschedule_ms_p999']:.3f} ms > "
            f"{args.max_deschedule_p999_ms} ms"
        )
    ratio = summary.get("cpu_ratio")
    if ratio is not None and ratio > args.max_cpu_ratio:
        failures.append(f"process/thread CPU ratio {ratio:.3f} > {args.max_cpu_ratio}")
    jitter = result["latency_jitter"]
    if args.max_jitter is not None and (jitter is None or jitter > args.max_jitter):
        failures.append(
            f"round-trip jitter (std/mean) {'n/a' if jitter is None else f'{jitter:.3f}'} > "
            f"{args.max_jitter}"
        )
    if result["slow_infer"] > args.max_slow_infer:
        failures.append(f"{result['slow_infer']} slow_infer batches > {args.max_slow_infer}")
    return failures


def cmd_probe(args) -> int:
    """Health probe: every worker of the server is ready and answers one request."""
    rng = np.random.default_rng(0)
    started = time.monotonic()
    with _connect(args) as client:
        client.wait_ready(args.ready_timeout)
        latencies = []
        # The client hands requests to its lanes round-robin: one request per worker.
        for _lane in client.lanes:
            t0 = time.perf_counter_ns()
            client.infer(_inputs_for(client.model, 1, rng))
            latencies.append(round((time.perf_counter_ns() - t0) / 1e6, 3))
        registry = read_registry(args.name)
    print(
        json.dumps(
            {
                "server": args.name,
                "ready": True,
                "pid": registry.get("pid"),
                "worker_cpus": [worker["cpu"] for worker in registry["workers"]],
                "latency_ms": latencies,
                "probe_s": round(time.monotonic() - started, 3),
            }
        )
    )
    return 0


def _print_smoke(result):
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    table = Table(title=f"shminfer smoke: {result['server']}", title_justify="left")
    table.add_column("measure")
    for col in ("p50", "p99", "p99.9", "max"):
        table.add_column(col, justify="right")
    table.add_row(
        "round trip (ms)",
        *(f"{result[f'latency_ms_{k}']:.3f}" for k in ("p50", "p99", "p999", "max")),
    )
    if result.get("batches"):
        for label, key in (
            ("infer wall (ms)", "wall_ms"),
            ("deschedule (ms)", "deschedule_ms"),
            ("queue wait (ms)", "queue_wait_ms"),
        ):
            table.add_row(
                label, *(f"{result[f'{key}_{k}']:.3f}" for k in ("p50", "p99", "p999", "max"))
            )
    console = Console(highlight=False)
    console.print(table)
    console.print(f"client CPUs (as it ran): {result.get('client_cpus', 'n/a')}")
    ratio = result.get("cpu_ratio")
    jitter = result.get("latency_jitter")
    console.print(
        f"requests {result['requests']}, errors {result['errors']}, batches "
        f"{result.get('batches', 0)} (mean size {result.get('mean_batch', 0):.2f}), "
        f"slow_infer {result['slow_infer']}, process/thread CPU ratio "
        f"{'n/a' if ratio is None else f'{ratio:.3f}'}, round-trip jitter (std/mean) "
        f"{'n/a' if jitter is None else f'{jitter:.3f}'}"
    )
    console.print("PASSED" if result["passed"] else "FAILED: " + "; ".join(result["failures"]))


def cmd_stats(args) -> int:
    from shminfer.metrics import collect, prometheus_text  # noqa: PLC0415

    sock, answer, segments = attach(args.name, 0, args.timeout)
    try:
        per_cpu = collect({w["cpu"]: seg for w, seg in zip(answer["workers"], segments)})
    finally:
        for segment in segments:
            segment.close()
        sock.close()
    if args.format == "prometheus":
        print(prometheus_text(args.name, per_cpu), end="")
    else:
        print(json.dumps({"server": args.name, "workers": per_cpu}, indent=2))
    return 0


def cmd_where(args) -> int:
    """Which unit this process (or --cpus) would use, and why (shminfer.locality)."""
    from shminfer.locality import where  # noqa: PLC0415

    choice = where(args.cpus, match=args.match, root=args.root)
    if args.format == "json":
        print(json.dumps(choice.as_dict(), indent=2))
        return 0
    print(f"unit: {choice.name}")
    print(f"why: {choice.reason}")
    print("units on this host:")
    width = max(len(u["name"]) for u in choice.units)
    for unit in choice.units:
        mark = "*" if unit["name"] == choice.name else " "
        groups = ",".join(map(str, unit["l3_groups"])) or "-"
        print(
            f" {mark} {unit['name']:<{width}}  node {unit['node']:<3} L3 {groups:<6} "
            f"CPUs {unit['cpus']}"
        )
    return 0


def cmd_make_model(args) -> int:
    for path in make_model(args.path, inputs=args.inputs, hidden=args.hidden, outputs=args.outputs):
        print(path)
    return 0


def cmd_bench(args) -> int:
    if args.what == "ray":
        from shminfer import bench_ray  # noqa: PLC0415

        return bench_ray.main(args)
    from shminfer import bench  # noqa: PLC0415

    return bench.main(args)


def build_parser() -> argparse.ArgumentParser:
    return cli_options.build_parser(
        __doc__,
        {
            "serve": cmd_serve,
            "smoke": cmd_smoke,
            "probe": cmd_probe,
            "stats": cmd_stats,
            "where": cmd_where,
            "make-model": cmd_make_model,
            "bench": cmd_bench,
        },
    )


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (QueueError, BackendError, PayloadError, ValueError, OSError) as exc:
        print(f"shminfer: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
