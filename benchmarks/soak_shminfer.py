#!/usr/bin/env python3
"""Soak: one shminfer unit, 8 honest clients and one peer cycling through every attack of
issue 27 (tests/shminfer_attacks.py) for N minutes, a worker killed now and then.

Prints the figures and the issue's targets: 0 wrong answers, honest error rate below
0.1 %, the unit serving at the end, nothing leaked (every slot leasable again, the
supervisor's descriptors and threads back to where they were). Exit 1 when one is missed.
Run from the repo root: .venv/bin/python benchmarks/soak_shminfer.py [--minutes 10]
(`make soak`); SHMINFER_PURE=1 soaks the pure-Python path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from shminfer_attacks import check_outcomes, soak  # noqa: E402

TARGET_ERROR_RATE = 0.001


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--honest", type=int, default=8, help="honest clients")
    parser.add_argument(
        "--kill-every-s", type=float, default=60.0, help="kill a worker this often (0: never)"
    )
    args = parser.parse_args()
    # The unit publishes in a directory of its own, never a deployed host's /run/shminfer.
    os.environ["SHMINFER_DIR"] = tempfile.mkdtemp(prefix="shminfer-soak-")
    with open(Path(os.environ["SHMINFER_DIR"]) / "unit.log", "w", encoding="utf-8") as log:
        figures = soak(
            args.minutes * 60, args.honest, kill_every_s=args.kill_every_s or None, log=log
        )
    problems = []
    for report in figures.pop("reports"):
        try:
            check_outcomes(report)
        except AssertionError as exc:
            problems.append(str(exc))
    fds, threads = figures["fds_before_after"], figures["threads_before_after"]
    checks = {
        "0 wrong answers": figures["wrong"] == 0 and not problems,
        "honest error rate < 0.1 %": figures["error_rate"] < TARGET_ERROR_RATE,
        "serving at the end": figures["serving_at_end"],
        "every slot leasable at the end": figures["slots_leasable_at_end"].split("/")[0]
        == figures["slots_leasable_at_end"].split("/")[1],
        "no descriptor or thread leaked": fds[1] <= fds[0] and threads[1] <= threads[0],
    }
    figures["error_rate_pct"] = round(100 * figures.pop("error_rate"), 5)
    figures["unit_log"] = str(Path(os.environ["SHMINFER_DIR"]) / "unit.log")
    print(json.dumps(figures, indent=2))
    for check, held in checks.items():
        print(f"{'PASS' if held else 'FAIL'}  {check}")
    for problem in problems:
        print(f"      {problem}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
