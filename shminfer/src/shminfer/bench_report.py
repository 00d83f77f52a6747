"""`shminfer bench ipc`'s verdicts and table: the issue's speed targets judged from a run's
numbers, and the report printed as rich tables (bench.py measures)."""

from __future__ import annotations


def targets(results) -> list:
    """Issue 12's speed targets, judged from this run's numbers: [(name, value, pass)]."""
    shm = results["shminfer"]
    out = []
    if "iceoryx2" in results:
        ratio = shm["p50_us"] / results["iceoryx2"]["p50_us"]
        out.append(("shminfer p50 / iceoryx2 p50 <= 0.5", round(ratio, 3), ratio <= 0.5))
    if "pipe_pickle" in results:
        pipe = results["pipe_pickle"]
        ratio = pipe["p50_us"] / shm["p50_us"]
        out.append(("pipe_pickle p50 / shminfer p50 >= 20", round(ratio, 1), ratio >= 20))
        if "after_1s_idle_p50_us" in shm and "after_1s_idle_p50_us" in pipe:
            ours, theirs = shm["after_1s_idle_p50_us"], pipe["after_1s_idle_p50_us"]
            out.append(
                (
                    "first request after 1 s idle (µs): shminfer < pipe_pickle",
                    f"{ours} vs {theirs}",
                    ours < theirs,
                )
            )
    if "rps_4_in_flight" in shm:
        rps = shm["rps_4_in_flight"]
        out.append(("shminfer req/s with 4 in flight >= 100000", rps, rps >= 100_000))
    if "shminfer_pure" in results:
        c, pure = shm["p50_us"], results["shminfer_pure"]["p50_us"]
        out.append(
            (
                "p50 (µs): C path <= 12 and pure-Python fallback <= 20",
                f"{c} and {pure}",
                c <= 12 and pure <= 20,
            )
        )
    return out


def print_report(report):
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    console = Console(highlight=False, width=160)
    table = Table(title="IPC echo 16 KiB -> 32 KiB, pinned client/server", title_justify="left")
    for col in (
        "variant",
        "p50 µs",
        "p99 µs",
        "p99.9 µs",
        "max µs",
        "req/s",
        "req/s @4",
        "1st after idle µs",
        "p50 vs shminfer",
    ):
        table.add_column(col, justify="right")
    ratios = report.get("ratios_vs_shminfer_p50", {})
    for name, r in report["variants"].items():
        table.add_row(
            name,
            f"{r['p50_us']:.1f}",
            f"{r['p99_us']:.1f}",
            f"{r['p999_us']:.1f}",
            f"{r['max_us']:.0f}",
            f"{r['rps']:.0f}",
            f"{r['rps_4_in_flight']:.0f}" if "rps_4_in_flight" in r else "-",
            f"{r['after_1s_idle_p50_us']:.1f}" if "after_1s_idle_p50_us" in r else "-",
            "1.0x" if name == "shminfer" else (f"{ratios[name]}x" if name in ratios else "-"),
        )
    console.print(table)
    d = report.get("deschedule_1thread_model")
    if d:
        console.print(
            f"1-thread numpy MLP on shminfer: deschedule p50 {d['p50_ms']} ms, p99 {d['p99_ms']} "
            f"ms, p99.9 {d['p999_ms']} ms; process/thread CPU ratio {d['cpu_ratio']}"
        )
    for note in report.get("skipped", []):
        console.print(f"skipped: {note}")
    together = report.get("interleaved")
    if together:
        line = f"measured interleaved in {len(together['rounds_p50_us'])} rounds: " + ", ".join(
            together["variants"]
        )
        by_round = together["rounds_p50_us"]
        if "iceoryx2" in together["variants"] and "shminfer" in together["variants"]:
            ratios = [r["shminfer"] / r["iceoryx2"] for r in by_round if r.get("iceoryx2")]
            if ratios:
                line += f"; shminfer / iceoryx2 p50 per round {min(ratios):.2f}-{max(ratios):.2f}"
        console.print(line)
    console.print(
        f"shminfer ran its {report['shminfer_path']} path; load average (1 min) "
        f"{report['load_avg_1m_start']} at the start, {report['load_avg_1m']} at the end"
    )
    for name, value, ok in report.get("targets", []):
        console.print(f"{'PASS' if ok else 'FAIL'}  {name}: {value}")
