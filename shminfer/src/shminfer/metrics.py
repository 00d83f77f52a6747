"""Per-batch metrics from the workers' rings: percentiles, Prometheus text, tables.

deschedule_ms = wall - process CPU, per batch (the field reports' measure of time the
inference thread was runnable but not running); the process/thread CPU ratio is ~1 when
the worker is isolated (no other thread in the process competes with inference).

Which batches have an exact CPU time (worker.py, queue.CPU_EXACT_NS): every batch whose
wall time reached 0.1 ms, and the ones whose thread clock was sampled. A shorter batch
may carry CPU_NOT_MEASURED: its deschedule is taken as its whole wall time, an upper bound
below 0.1 ms, so it can neither hide a deschedule nor push the deschedule percentiles past
any gate of 0.1 ms or more (the post-check's is 1 ms); the CPU percentiles and the CPU
ratio use the measured batches only ("cpu_measured_batches" says how many).
"""

from __future__ import annotations

import numpy as np

from shminfer.queue import CPU_NOT_MEASURED, RING_FIELDS

# Ring records arrive as float64: the sentinel 2**64-1 reads as 2**64; real CPU times are
# far below 2**63.
_NOT_MEASURED_F = float(CPU_NOT_MEASURED >> 1)

QUANTILES = (0.5, 0.99, 0.999)


def cpu_measured(cpu_ns: np.ndarray) -> np.ndarray:
    """Where a ring column of CPU times was read, not CPU_NOT_MEASURED (a short batch)."""
    return cpu_ns < _NOT_MEASURED_F


# A worker's slow_infer thresholds unless it was given others (worker.py's defaults).
SLOW_CPU_MS = 100.0
SLOW_WALL_MS = 200.0
_CPU_COL = RING_FIELDS.index("process_cpu_ns")
_WALL_COL = RING_FIELDS.index("wall_ns")


def slow_batches(
    records: np.ndarray, slow_cpu_ms: float = SLOW_CPU_MS, slow_wall_ms: float = SLOW_WALL_MS
) -> int:
    """Batches whose measured CPU time or wall time crossed the slow_infer thresholds."""
    if records.size == 0:
        return 0
    cpu = records[:, _CPU_COL]
    slow_cpu = (cpu > slow_cpu_ms * 1e6) & cpu_measured(cpu)
    return int((slow_cpu | (records[:, _WALL_COL] > slow_wall_ms * 1e6)).sum())


def summarize(records: np.ndarray) -> dict:
    """Percentiles and ratios of ring records (rows of RING_FIELDS)."""
    if records.size == 0:
        return {"batches": 0}
    col = {name: records[:, i] for i, name in enumerate(RING_FIELDS)}
    wall_ms = col["wall_ns"] / 1e6
    measured = cpu_measured(col["process_cpu_ns"])
    cpu_ms = col["process_cpu_ns"] / 1e6
    # Unmeasured (short) batches: deschedule <= wall, and wall < CPU_EXACT_NS.
    deschedule_ms = np.where(measured, np.maximum(0.0, wall_ms - cpu_ms), wall_ms)
    cpu_ms = cpu_ms[measured]
    both = measured & cpu_measured(col["thread_cpu_ns"])
    cpu_sampled_ms = col["process_cpu_ns"][both] / 1e6
    thread_ms = col["thread_cpu_ns"][both] / 1e6
    wait_ms = col["queue_wait_ns"] / 1e6
    out = {
        "batches": int(records.shape[0]),
        "samples": int(col["batch"].sum()),
        "mean_batch": float(col["batch"].mean()),
        "cpu_measured_batches": int(measured.sum()),
    }
    for label, values in (
        ("wall_ms", wall_ms),
        ("deschedule_ms", deschedule_ms),
        ("queue_wait_ms", wait_ms),
        ("cpu_ms", cpu_ms),
    ):
        for q in QUANTILES:
            out[f"{label}_p{_qname(q)}"] = float(np.quantile(values, q)) if values.size else None
        out[f"{label}_max"] = float(values.max()) if values.size else None
    thread_total = thread_ms.sum()
    out["cpu_ratio"] = float(cpu_sampled_ms.sum() / thread_total) if thread_total > 0 else None
    return out


def _qname(q: float) -> str:
    return {0.5: "50", 0.99: "99", 0.999: "999"}[q]


def collect(
    segments: dict, slow_cpu_ms: float = SLOW_CPU_MS, slow_wall_ms: float = SLOW_WALL_MS
) -> dict:
    """{cpu: summary} for every worker segment (reads the whole ring), with the count of
    slow_infer batches in that window."""
    out = {}
    for cpu, segment in segments.items():
        records = segment.ring_read()[0]
        out[cpu] = summarize(records)
        out[cpu]["slow_infer"] = slow_batches(records, slow_cpu_ms, slow_wall_ms)
    return out


def prometheus_text(name: str, per_cpu: dict, restarts: dict | None = None) -> str:
    lines = []

    def metric(metric_name, kind, help_text, samples):
        lines.append(f"# HELP shminfer_{metric_name} {help_text}")
        lines.append(f"# TYPE shminfer_{metric_name} {kind}")
        for labels, value in samples:
            label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
            lines.append(f"shminfer_{metric_name}{{{label_text}}} {value}")

    for field, help_text in (
        ("wall_ms", "Inference wall time per batch (ring window), milliseconds."),
        ("deschedule_ms", "Wall minus process CPU per batch (ring window), milliseconds."),
        ("queue_wait_ms", "Time the oldest request of a batch waited, milliseconds."),
    ):
        samples = []
        for cpu, summary in per_cpu.items():
            if not summary.get("batches"):
                continue
            for q in QUANTILES:
                samples.append(
                    (
                        {"server": name, "cpu": cpu, "quantile": str(q)},
                        summary[f"{field}_p{_qname(q)}"],
                    )
                )
        metric(field, "gauge", help_text, samples)
    metric(
        "batches",
        "gauge",
        "Batches in the ring window.",
        [({"server": name, "cpu": cpu}, s.get("batches", 0)) for cpu, s in per_cpu.items()],
    )
    metric(
        "slow_infer_batches",
        "gauge",
        "Batches in the ring window over the worker's slow_infer CPU or wall threshold.",
        [({"server": name, "cpu": cpu}, s.get("slow_infer", 0)) for cpu, s in per_cpu.items()],
    )
    metric(
        "cpu_ratio",
        "gauge",
        "Process CPU / inference-thread CPU (1 means isolated).",
        [
            ({"server": name, "cpu": cpu}, s["cpu_ratio"])
            for cpu, s in per_cpu.items()
            if s.get("cpu_ratio") is not None
        ],
    )
    if restarts is not None:
        metric(
            "worker_restarts_total",
            "counter",
            "Worker restarts since the server started.",
            [({"server": name, "cpu": cpu}, n) for cpu, n in restarts.items()],
        )
    return "\n".join(lines) + "\n"
