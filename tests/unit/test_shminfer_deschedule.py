"""The deschedule metric on real worker processes: exact where a gate can see it.

The worker reads the process CPU clock at the end of a batch only when its wall time
reached queue.CPU_EXACT_NS (0.1 ms); shorter batches record CPU_NOT_MEASURED and count
their wall time as deschedule (metrics.py). These tests force a deschedule (SIGSTOP of
the worker mid-batch) and check it is measured exactly, and check that a run of short
batches reports nothing past the gate that the batches did not really suffer.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
from shminfer_serving import serving

from shminfer import cli
from shminfer.client import Client
from shminfer.metrics import cpu_measured, summarize
from shminfer.queue import CPU_EXACT_NS, CPU_NOT_MEASURED, RING_FIELDS

WALL = RING_FIELDS.index("wall_ns")
CPU = RING_FIELDS.index("process_cpu_ns")
THREAD = RING_FIELDS.index("thread_cpu_ns")
GATE_MS = 1.0  # the post-check's default deschedule p99.9 gate
X = {"x": np.ones((1, 32), np.float64)}


def _records(client, since):
    return client.lanes[0].seg.ring_read(since)[0]


def _batches(requests, *backend):
    """The ring records of ``requests`` one-request batches, after a warm-up request."""
    with serving(*backend) as server, Client(server.name, timeout=10) as client:
        client.wait_ready(60)
        client.infer(X)
        head = client.lanes[0].seg.get("ring_head")
        for _ in range(requests):
            client.infer(X)
        return _records(client, head)


def test_a_worker_stopped_mid_batch_shows_its_deschedule_exactly():
    # burn: 150 ms of the worker thread's CPU, however long that takes in wall time.
    with serving("burn", "150") as server, Client(server.name, timeout=10) as client:
        client.wait_ready(60)
        client.infer(X)
        seg = client.lanes[0].seg
        head = seg.get("ring_head")
        worker = seg.get("worker_pid")
        pending = client.start(X)
        time.sleep(0.04)  # inside the burn
        os.kill(worker, signal.SIGSTOP)
        try:
            time.sleep(0.3)
        finally:
            os.kill(worker, signal.SIGCONT)
        assert client.finish(pending)["y"].shape == (1, 64)
        records = _records(client, head)
    assert records.shape[0] == 1
    wall_ms = records[0, WALL] / 1e6
    cpu_ms = records[0, CPU] / 1e6
    assert cpu_measured(records[0, CPU]), "a 450 ms batch must be measured"
    assert 140 <= cpu_ms <= wall_ms
    deschedule = summarize(records)["deschedule_ms_p999"]
    assert deschedule >= 280, (wall_ms, cpu_ms)  # the 300 ms stop, not hidden
    assert abs(deschedule - (wall_ms - cpu_ms)) < 1e-6  # exactly wall - CPU


def test_a_stopped_short_batch_is_measured_too():
    # A batch of µs that the stop stretches past CPU_EXACT_NS is measured exactly: the stop
    # lands while the worker is in the batch or waiting; either way nothing is hidden.
    with serving("sleep", "20") as server, Client(server.name, timeout=10) as client:
        client.wait_ready(60)
        seg = client.lanes[0].seg
        head = seg.get("ring_head")
        worker = seg.get("worker_pid")
        pending = client.start(X)
        time.sleep(0.005)
        os.kill(worker, signal.SIGSTOP)
        threading.Timer(0.2, os.kill, (worker, signal.SIGCONT)).start()
        client.finish(pending)
        records = _records(client, head)
    assert records.shape[0] == 1
    assert records[0, WALL] >= 200e6
    assert cpu_measured(records[0, CPU])
    assert summarize(records)["deschedule_ms_max"] >= 190


def test_a_stop_while_the_worker_spins_is_not_a_batch_deschedule():
    # The C loop takes a batch's start CPU from a clock reading of its spin when that is
    # at most 0.01 ms old (_fast.c, SPIN_CPU_MAX_AGE_NS). A worker stopped while spinning
    # for work, with a request arriving meanwhile, must not count the stop in the 5 ms
    # batch: it came before the claim (the queue wait shows it), and the batch keeps its
    # 5 ms of CPU. The stop lands at the spin's CPU clock syscall; the reading is kept
    # only if its wall time, read after the CPU clock, is fresh at the claim (a wall time
    # read first, or no age check, takes the stop off the batch's CPU: 0 ms, the whole
    # batch as deschedule). The CPU is checked, not the deschedule, which the parallel
    # tests' real preemptions of this 2-core machine may raise.
    burn_ms = 5.0
    with (
        serving("burn", str(burn_ms), spin_us=5_000_000) as server,
        Client(server.name, timeout=10, slots_per_worker=1) as client,
    ):
        client.wait_ready(60)
        client.infer(X)  # the slot's layout: its next requests take the C loop's path
        seg = client.lanes[0].seg
        worker = seg.get("worker_pid")
        cpus, waits = [], []
        for _ in range(3):
            client.infer(X)
            time.sleep(0.02)  # the worker spins (5 s) for the next request
            head = seg.get("ring_head")
            os.kill(worker, signal.SIGSTOP)
            try:
                pending = client.start(X)
                time.sleep(0.1)
            finally:
                os.kill(worker, signal.SIGCONT)
            client.finish(pending)
            (record,) = _records(client, head)
            assert cpu_measured(record[CPU])
            cpus.append(record[CPU] / 1e6)
            waits.append(record[RING_FIELDS.index("queue_wait_ns")] / 1e6)
    assert min(waits) >= 90, waits  # the stop is the request's wait in the queue ...
    assert min(cpus) >= 0.95 * burn_ms, cpus  # ... and the batch has its whole CPU


def test_short_batches_report_no_deschedule_past_the_gate():
    records = _batches(3000, "echo")
    measured = cpu_measured(records[:, CPU])
    assert records.shape[0] == 3000
    assert (~measured).sum() > 1500, "echo batches are µs: most must take the short path"
    # Every batch that reached the threshold has its exact CPU time ...
    assert measured[records[:, WALL] >= CPU_EXACT_NS].all()
    # ... so an unmeasured batch's deschedule (its wall time) stays below 0.1 ms, and any
    # batch past the gate is one whose exact wall - CPU is past it (a real deschedule of
    # this loaded 2-core machine, not an artefact of skipped clocks).
    assert (records[~measured, WALL] < CPU_EXACT_NS).all()
    exact = np.maximum(0.0, records[:, WALL] - records[:, CPU]) / 1e6
    summary = summarize(records)
    past = int((np.where(measured, exact, records[:, WALL] / 1e6) > GATE_MS).sum())
    assert past == int((measured & (exact > GATE_MS)).sum())
    if not past:
        assert summary["deschedule_ms_max"] <= GATE_MS
    assert summary["cpu_measured_batches"] == int(measured.sum())


def test_batches_over_the_threshold_carry_exact_cpu():
    # 0.2 ms of CPU a batch: every batch is past CPU_EXACT_NS, so every one is measured.
    records = _batches(200, "burn", "0.2")
    assert cpu_measured(records[:, CPU]).all()
    assert (records[:, CPU] >= 0.19e6).all()
    summary = summarize(records)
    assert summary["cpu_ms_p50"] >= 0.19
    assert summary["cpu_ratio"] is not None  # thread clock sampled every 16th batch


def test_summary_semantics_of_unmeasured_batches():
    n = CPU_NOT_MEASURED
    rows = np.array(
        [
            # done, wall, process cpu, thread cpu, queue wait, batch
            (1, 50_000, n, n, 0, 1),  # short, unmeasured: deschedule <= its wall
            (2, 2_000_000, 500_000, n, 0, 1),  # measured: 1.5 ms deschedule, exact
            (3, 300_000, 300_000, 300_000, 0, 1),  # measured and thread-sampled
        ],
        dtype=np.float64,
    )
    summary = summarize(rows)
    assert summary["deschedule_ms_max"] == 1.5
    assert summary["deschedule_ms_p50"] == 0.05
    assert summary["cpu_measured_batches"] == 2
    assert summary["cpu_ms_max"] == 0.5
    assert summary["cpu_ratio"] == 1.0
    only_short = summarize(rows[:1])
    assert only_short["cpu_ms_p50"] is None and only_short["cpu_ratio"] is None
    assert only_short["deschedule_ms_p999"] == 0.05


def test_smoke_refuses_a_gate_below_the_exact_threshold(capsys):
    code = cli.main(["smoke", "--name", "nosuch", "--max-deschedule-p999-ms", "0.05"])
    assert code == 2
    assert "at least 0.1" in capsys.readouterr().err
