"""`shminfer`'s command line: its subcommands and their options (cli.py runs them)."""

from __future__ import annotations

import argparse

from shminfer.backends import BACKENDS
from shminfer.limits import CGROUP_ROOT, HEALTH_EVERY_S, HEALTH_GRACE_S, HEALTH_STUCK_S
from shminfer.queue import MAX_SLOT_BYTES, MAX_SLOTS


def _cpulist(text: str) -> list[int]:
    from shminfer.cpulist import TopologyError, parse_cpulist  # noqa: PLC0415

    try:
        cpus = parse_cpulist(text, "--cpus")
    except TopologyError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not cpus:
        raise argparse.ArgumentTypeError("--cpus is empty")
    return cpus


def _bounded(flag: str, low, high, kind=int):
    """argparse type: a ``kind`` (int, or float) in low..high, else a one-line error."""
    noun = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = int(text, 0) if kind is int else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes {noun}, got {text!r}") from None
        if not low <= value <= high:
            shown = str if kind is int else "{:g}".format
            raise argparse.ArgumentTypeError(
                f"{flag} must be {shown(low)}..{shown(high)}, got {shown(value)}"
            )
        return value

    return parse


def build_parser(description: str, commands: dict) -> argparse.ArgumentParser:
    """The parser; ``commands``: each subcommand's function (its ``func`` default), by the
    subcommand's name."""
    parser = argparse.ArgumentParser(prog="shminfer", description=description)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub, commands["serve"])
    _add_smoke(sub, commands["smoke"])
    _add_probe(sub, commands["probe"])
    _add_stats(sub, commands["stats"])
    _add_where(sub, commands["where"])
    _add_make_model(sub, commands["make-model"])
    _add_bench(sub, commands["bench"])
    return parser


def _add_serve(sub, func):
    """`shminfer serve` and its options."""
    serve = sub.add_parser("serve", help="run a server: one pinned worker per CPU")
    _serve_unit_args(serve)
    _serve_health_args(serve)
    _serve_worker_args(serve)
    _serve_metrics_args(serve)
    serve.set_defaults(func=func)


def _serve_unit_args(serve):
    """The unit: its name, CPUs, memory node, backend, model and queues."""
    serve.add_argument(
        "--name",
        required=True,
        help="server name (its directory: $SHMINFER_DIR/NAME, default /run/shminfer/NAME)",
    )
    serve.add_argument("--cpus", required=True, type=_cpulist, help="worker CPUs, e.g. 2-7")
    serve.add_argument(
        "--numa-node",
        type=int,
        help="bind the queue memory here (default: the node of --cpus; -1 disables binding)",
    )
    serve.add_argument("--backend", choices=sorted(BACKENDS), default="openvino")
    serve.add_argument("--model", help="model path (.xml for openvino, .npz for numpy)")
    serve.add_argument("--slots", type=_bounded("--slots", 1, MAX_SLOTS), default=64)
    serve.add_argument(
        "--request-bytes", type=_bounded("--request-bytes", 64, MAX_SLOT_BYTES), default=65536
    )
    serve.add_argument(
        "--response-bytes", type=_bounded("--response-bytes", 64, MAX_SLOT_BYTES), default=65536
    )
    serve.add_argument(
        "--batch-deadline-s",
        type=float,
        default=30.0,
        help="a batch running longer gets its worker killed and restarted, its requests an error",
    )


def _serve_health_args(serve):
    """The supervisor's health check."""
    serve.add_argument(
        "--health-every-s",
        type=_bounded("--health-every-s", 0.0, 3600.0, float),
        default=HEALTH_EVERY_S,
        help="the supervisor's health check period: its own client attaches, and no request "
        f"sits READY for an idle worker (0: off; default {HEALTH_EVERY_S:g})",
    )
    serve.add_argument(
        "--health-stuck-s",
        type=_bounded("--health-stuck-s", 0.1, 3600.0, float),
        default=HEALTH_STUCK_S,
        help="a request READY this long while its worker is idle and claims nothing fails the "
        f"check (default {HEALTH_STUCK_S:g})",
    )
    serve.add_argument(
        "--health-grace-s",
        type=_bounded("--health-grace-s", 0.0, 3600.0, float),
        default=HEALTH_GRACE_S,
        help="checks failing this long stop the watchdog pings and end the server with exit "
        f"code 2 (default {HEALTH_GRACE_S:g})",
    )
    serve.add_argument("--cgroup-root", default=CGROUP_ROOT, help=argparse.SUPPRESS)  # tests


def _serve_worker_args(serve):
    """The workers: batching, idle spin, scheduling, slow_infer; the files' group."""
    serve.add_argument("--min-batch", type=int, default=1)
    serve.add_argument("--max-batch", type=int, default=16)
    serve.add_argument(
        "--max-wait-us", type=int, default=0, help="how long to wait for --min-batch requests"
    )
    serve.add_argument("--spin-us", type=int, default=50, help="idle spin before sleeping")
    serve.add_argument(
        "--sched",
        choices=("infer", "always", "off"),
        default="infer",
        help="SCHED_FIFO while inferring, always, or never",
    )
    serve.add_argument("--rt-priority", type=int, default=10)
    serve.add_argument("--slow-cpu-ms", type=float, default=100.0)
    serve.add_argument("--slow-wall-ms", type=float, default=200.0)
    serve.add_argument("--group", help="share segments with this group (mode 0660)")


def _serve_metrics_args(serve):
    """Metrics: the HTTP endpoint and node_exporter's textfile."""
    serve.add_argument(
        "--metrics-port",
        type=_bounded("--metrics-port", 0, 65535),
        help="serve /metrics on 127.0.0.1:PORT",
    )
    serve.add_argument(
        "--metrics-textfile",
        metavar="PATH",
        help="write the metrics to PATH every --metrics-every-s seconds, atomically, for "
        "node_exporter's textfile collector (PATH ends in .prom, or is linked from its "
        "directory)",
    )
    serve.add_argument(
        "--metrics-every-s",
        type=_bounded("--metrics-every-s", 0.5, 3600.0, float),
        default=10.0,
        help="how often --metrics-textfile is rewritten (default 10)",
    )


def _add_smoke(sub, func):
    """`shminfer smoke` and its gates."""
    smoke = sub.add_parser("smoke", help="N requests against a running server, with gates")
    smoke.add_argument(
        "--name",
        help="the server; default: the running unit nearest to this process's CPUs "
        "(as `shminfer where` picks it, among names matching --match)",
    )
    smoke.add_argument("--match", default="*", help="glob on unit names, without --name")
    smoke.add_argument("-n", "--requests", type=int, default=1000)
    smoke.add_argument("--warmup", type=int, default=50)
    smoke.add_argument("--batch", type=int, default=1)
    smoke.add_argument("--timeout", type=float, default=5.0)
    smoke.add_argument("--ready-timeout", type=float, default=60.0)
    smoke.add_argument("--max-p99-ms", type=float, default=50.0)
    smoke.add_argument("--max-deschedule-p999-ms", type=float, default=1.0)
    smoke.add_argument("--max-cpu-ratio", type=float, default=1.2)
    smoke.add_argument("--max-errors", type=int, default=0)
    smoke.add_argument("--max-slow-infer", type=int, default=0)
    smoke.add_argument(
        "--max-jitter",
        type=float,
        default=None,
        help="fail when the round trip's standard deviation / mean exceeds this (e.g. 0.2)",
    )
    smoke.add_argument("--slow-cpu-ms", type=float, default=100.0)
    smoke.add_argument("--slow-wall-ms", type=float, default=200.0)
    smoke.add_argument("--format", choices=("table", "json"), default="table")
    smoke.set_defaults(func=func)


def _add_probe(sub, func):
    """`shminfer probe`."""
    probe = sub.add_parser("probe", help="health probe: workers ready, one request each")
    probe.add_argument("--name", required=True)
    probe.add_argument("--timeout", type=float, default=5.0)
    probe.add_argument("--ready-timeout", type=float, default=60.0)
    probe.set_defaults(func=func)


def _add_stats(sub, func):
    """`shminfer stats`."""
    stats = sub.add_parser("stats", help="percentiles from a running server's rings")
    stats.add_argument("--name", required=True)
    stats.add_argument("--format", choices=("json", "prometheus"), default="json")
    stats.add_argument("--timeout", type=float, default=5.0)
    stats.set_defaults(func=func)


def _add_where(sub, func):
    """`shminfer where`."""
    near = sub.add_parser(
        "where", help="which unit a process on these CPUs would use (nearest by NUMA/L3), and why"
    )
    near.add_argument(
        "--cpus", type=_cpulist, default=None, help="the caller's CPUs (default: this process's)"
    )
    near.add_argument("--match", default="*", help="only units whose name matches this glob")
    near.add_argument("--root", default="/", help=argparse.SUPPRESS)  # a sysfs tree, for tests
    near.add_argument("--format", choices=("text", "json"), default="text")
    near.set_defaults(func=func)


def _add_make_model(sub, func):
    """`shminfer make-model`."""
    model = sub.add_parser("make-model", help="write a small MLP (.npz + OpenVINO IR), no download")
    model.add_argument("path")
    model.add_argument("--inputs", type=int, default=64)
    model.add_argument("--hidden", type=int, default=256)
    model.add_argument("--outputs", type=int, default=16)
    model.set_defaults(func=func)


def _add_bench(sub, func):
    """`shminfer bench`."""
    bench = sub.add_parser("bench", help="benchmarks (ipc: this runtime vs baselines)")
    bench.add_argument(
        "what", choices=("ipc", "ray"), help="ipc: against other IPC; ray: against Ray actors"
    )
    bench.add_argument("--requests", type=_bounded("--requests", 1, 10**8), default=20000)
    bench.add_argument("--idle-samples", type=int, default=10)
    bench.add_argument("--client-cpu", type=int, default=0)
    bench.add_argument("--server-cpu", type=int, default=1)
    bench.add_argument(
        "--variants", default="shminfer,shminfer_pure,pipe_pickle,tcp_pickle,sleep_poll,iceoryx2"
    )
    bench.add_argument("--format", choices=("table", "json"), default="table")
    bench.set_defaults(func=func)
