#!/usr/bin/env python3
"""Benchmark: topology discovery + partition planning on a 2-socket, 256-CPU tree.

Prints the median and p95 of N runs for each phase and the ratio to the 100 ms goal.
The tree is generated (tests/sysfs_gen.py) from the EPYC 7702P shape turned into a
2-socket 7763-like host: 2 x 64 cores x 2 threads, 8 cores per CCX, NPS1.
Run from the repo root: .venv/bin/python benchmarks/bench_plan.py [--runs N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from sysfs_gen import build_tree  # noqa: E402

from rtfleet.planner import plan_partition  # noqa: E402
from rtfleet.topology import read_topology  # noqa: E402

GOAL_MS = 100.0


def shape_256():
    shape = json.loads((REPO / "tests/fixtures/shapes/epyc-7702p-nps1.json").read_text())
    shape.update(name="bench-2s-256", sockets=2, source="benchmark: 2 x EPYC 7763-like")
    shape["l3"] = dict(shape["l3"], cores=8, size_kb=32768)
    return shape


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = build_tree(shape_256(), Path(tmp) / "root")
        topo = read_topology(str(root))
        assert len(topo["cpus"]) == 256, len(topo["cpus"])
        read_ms, plan_ms, total_ms = [], [], []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            topo = read_topology(str(root))
            t1 = time.perf_counter()
            plan_partition(topo, {"partial_l3_groups": "pod_pool"})
            t2 = time.perf_counter()
            read_ms.append((t1 - t0) * 1e3)
            plan_ms.append((t2 - t1) * 1e3)
            total_ms.append((t2 - t0) * 1e3)
    print(
        f"tree: 2 sockets, {len(topo['cpus'])} CPUs, {len(topo['l3_groups'])} L3 groups; "
        f"{args.runs} runs"
    )
    print(f"{'phase':<10}{'median ms':>12}{'p95 ms':>10}")
    for name, values in (("topology", read_ms), ("plan", plan_ms), ("total", total_ms)):
        print(f"{name:<10}{statistics.median(values):>12.2f}{percentile(values, 0.95):>10.2f}")
    median = statistics.median(total_ms)
    print(
        f"goal {GOAL_MS:.0f} ms: median total is {median / GOAL_MS:.2f}x the goal "
        f"({'met' if median < GOAL_MS else 'MISSED'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
