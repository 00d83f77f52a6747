"""The report's plots: PNG figures per host, drawn with matplotlib (Agg, files only).

:func:`write_plots` writes, for each host that has the figures, the cyclictest and oslat
histograms (a line per CPU) and worst case per CPU against the gate's limit, hwlatdetect's
samples above its threshold and the smoke round trip per unit, and records each file in the
host's ``plots``; report.py places them in the pages.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from .postcheck_gate import DEFAULT_HWLATDETECT_MAX_US, cyclictest_thresholds
from .report_files import ReportError, replacing, safe_name
from .report_tables import cpu_name

DEFAULT_MAX_US = 100


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
        from matplotlib.figure import Figure  # noqa: PLC0415
    except ImportError as exc:
        raise ReportError(
            "the report's plots need matplotlib (%s): pip install 'rtfleet[report]', or run "
            "`make setup` for the pinned tool chain" % exc
        ) from None

    def figure(width=8.0, height=4.5):
        fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)  # Agg: files only, no display needed
        return fig

    return figure


def _limit(value):
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _max_limit(entry, tool="cyclictest"):
    """The gate's worst-case limit for ``tool`` (cyclictest or oslat), as gate_host uses it."""
    ct_limit = cyclictest_thresholds(entry["thresholds"]).get("max_us", DEFAULT_MAX_US)
    if tool == "oslat":
        return _limit(entry["thresholds"].get("oslat_max_us", ct_limit))
    return _limit(ct_limit)


# Per tool: the title, the histogram's end in the summary, and what a count is.
_HIST_TOOLS = {
    "cyclictest": ("cyclictest latency", "histogram_us", "cycles"),
    "oslat": ("oslat loop gaps", "bucket_us", "loops"),
}


def _plot_histogram(figure, entry, path, tool="cyclictest"):
    ct = entry[tool]
    title, end_key, counted = _HIST_TOOLS[tool]
    limit = _max_limit(entry, tool)
    fig = figure()
    ax = fig.add_subplot()
    import numpy as np  # noqa: PLC0415  (a dependency of rtfleet already)

    many = len(ct["cpus"]) > 16
    rows = [row for row in ct["cpus"] if row["histogram"]]
    top = max(latency for row in rows for latency, _count in row["histogram"]) + 1
    # Log-spaced buckets: a tuned host's few µs and a VM's tens of ms fit on one axis, and
    # sparse 1 µs buckets of the tail do not turn into a comb.
    edges = np.unique(np.geomspace(1, max(top, 10), 60).round())
    hist_us = ct["summary"][end_key]
    for row in rows:
        xs = np.clip([latency for latency, _count in row["histogram"]], 1, None)
        ys = [count for _latency, count in row["histogram"]]
        counts = np.histogram(xs, bins=edges, weights=ys)[0]
        label = None
        if not many:
            label = "CPU %s" % cpu_name(row)
            if row["overflows"]:
                label += " (%d ≥ %d µs)" % (row["overflows"], hist_us)
        ax.stairs(counts, edges, linewidth=0.6 if many else 1.0, label=label)
    if limit is not None and limit <= edges[-1]:
        ax.axvline(limit, color="red", linestyle="--", linewidth=1, label="limit %g µs" % limit)
    if any(row["overflows"] for row in ct["cpus"]):
        ax.axvline(
            hist_us, color="grey", linestyle=":", linewidth=1, label="histogram end %d µs" % hist_us
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("latency (µs, log)")
    ax.set_ylabel("%s (log)" % counted)
    ax.set_title("%s: %s histogram" % (entry["host"], title))
    ax.grid(True, which="major", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # none with > 16 CPUs and the limit off the axis
        ax.legend(fontsize="small")
    fig.savefig(path)


def _plot_cpu_max(figure, entry, path, tool="cyclictest"):
    ct = entry[tool]
    limit = _max_limit(entry, tool)
    rows = ct["cpus"]
    fig = figure(max(6.0, min(20.0, 0.3 * len(rows) + 3)), 4.0)
    ax = fig.add_subplot()
    colors = [
        "tab:red" if limit is not None and row["max_us"] > limit else "tab:blue" for row in rows
    ]
    ax.bar([cpu_name(r) for r in rows], [r["max_us"] for r in rows], color=colors)
    if limit is not None:
        ax.axhline(limit, color="red", linestyle="--", linewidth=1, label="limit %g µs" % limit)
        ax.legend(fontsize="small")
    ax.set_xlabel("CPU")
    ax.set_ylabel("max latency (µs)")
    ax.set_title("%s: %s worst case per CPU" % (entry["host"], tool))
    ax.grid(True, axis="y", alpha=0.3)
    fig.savefig(path)


def _plot_hwlat(figure, entry, path):
    hw = entry["hwlatdetect"]
    limit = _limit(entry["thresholds"].get("hwlatdetect_max_us", DEFAULT_HWLATDETECT_MAX_US))
    fig = figure(8.0, 3.5)
    ax = fig.add_subplot()
    samples = hw["samples"]
    ts = [float(sample["ts"]) for sample in samples]
    start = min(ts)
    ax.scatter([t - start for t in ts], [s["inner_us"] for s in samples], s=12, label="inner")
    ax.scatter([t - start for t in ts], [s["outer_us"] for s in samples], s=12, label="outer")
    if limit is not None:
        ax.axhline(limit, color="red", linestyle="--", linewidth=1, label="limit %g µs" % limit)
    ax.set_yscale("log")
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("gap (µs, log)")
    ax.set_title("%s: hwlatdetect samples above the threshold" % entry["host"])
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path)


def _plot_smoke(figure, entry, path):
    units = entry["smoke"]
    fig = figure(max(6.0, min(20.0, 1.2 * len(units) + 3)), 4.0)
    ax = fig.add_subplot()
    stats = (("p50", "latency_ms_p50"), ("p99", "latency_ms_p99"), ("p99.9", "latency_ms_p999"))
    stats += (("max", "latency_ms_max"),)
    width = 0.8 / len(stats)
    for i, (label, key) in enumerate(stats):
        xs = [u + (i - (len(stats) - 1) / 2) * width for u in range(len(units))]
        ys = [float(unit.get(key) or 0.0) for unit in units]
        ax.bar(xs, ys, width=width, label=label)
    ax.set_xticks(range(len(units)))
    ax.set_xticklabels([str(unit.get("server")) for unit in units])
    ax.set_ylabel("round trip (ms)")
    ax.set_title("%s: shminfer smoke round trip per unit" % entry["host"])
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path)


def write_plots(hosts, plots_dir):
    """PNG plots per host into plots_dir; each host entry gets {"plots": {name: path}}."""
    figure = _matplotlib()
    plots_dir = Path(plots_dir)
    plots_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for entry in hosts:
        entry["plots"] = {}
        base = safe_name(entry["host"]) + ("-baseline" if entry["kind"] == "baseline" else "")
        ct = entry["cyclictest"]
        jobs = []
        if ct and "cpus" in ct:
            if any(row["histogram"] for row in ct["cpus"]):
                jobs.append(("latency_histogram", "latency-histogram", _plot_histogram))
            jobs.append(("cpu_max", "cpu-max", _plot_cpu_max))
        hw = entry.get("hwlatdetect")
        if hw and hw.get("samples"):
            jobs.append(("hwlat_samples", "hwlat-samples", _plot_hwlat))
        osl = entry.get("oslat")
        if osl and "cpus" in osl:
            jobs.append(
                ("oslat_histogram", "oslat-histogram", partial(_plot_histogram, tool="oslat"))
            )
            jobs.append(("oslat_cpu_max", "oslat-cpu-max", partial(_plot_cpu_max, tool="oslat")))
        if entry["smoke"]:
            jobs.append(("smoke_latency", "smoke-latency", _plot_smoke))
        for key, suffix, plot in jobs:
            path = plots_dir / ("%s-%s.png" % (base, suffix))
            with replacing(path) as tmp:
                plot(figure, entry, tmp)
            entry["plots"][key] = "%s/%s" % (plots_dir.name, path.name)
            written.append(path)
    return written


__all__ = ["write_plots"]
