"""The post-check's parsers: cyclictest, oslat and hwlatdetect output as per-CPU figures.

Each parser takes what the tool wrote (``cyclictest --json``, ``oslat --json``,
``hwlatdetect``'s standard output) as text or as the decoded document and returns plain
dicts of numbers, or raises :class:`~.postcheck.PostcheckError` saying what to fix. The gates
(``postcheck_gate.py``) and the report judge and show these figures; nothing here judges.

Cyclictest numbers
==================

cyclictest measures whole microseconds and, with ``--histogram=MAX_US``, counts each
cycle's latency in bucket ``latency`` when ``latency < MAX_US`` and as an overflow
otherwise (rt-tests ``cyclictest.c``: ``if (diff >= histogram) hist_overflow++``).
Percentiles here are nearest-rank over all cycles, overflows included: the p-th
percentile is the smallest latency L with at least ``ceil(p * cycles)`` cycles <= L. When
that rank falls among the overflows the value is unknown but at least MAX_US, and the row
says so (``p999_us: null, p999_beyond_histogram: true``) instead of inventing a number.
"""

from __future__ import annotations

import json
import re
import shlex

from .postcheck import PostcheckError
from .cpulist import format_cpulist

# (name, numerator, denominator): integer ranks, no float rounding at the boundary.
PERCENTILES = (("p99", 99, 100), ("p999", 999, 1000))


# --------------------------------------------------------------------------- cyclictest


def _plain_keys(doc):
    # rt-tests writes "cmdline:" and "rt_test_version:" with a trailing colon.
    return {str(k).rstrip(":"): v for k, v in doc.items()}


def _histogram_option(cmdline):
    """(MAX_US or None, nsecs) from a cyclictest command line."""
    try:
        words = shlex.split(cmdline or "")
    except ValueError:
        words = (cmdline or "").split()
    size = None
    nsecs = False
    for i, word in enumerate(words):
        nxt = words[i + 1] if i + 1 < len(words) else ""
        value = None
        if word in ("--nsecs", "-N"):
            nsecs = True
        elif word.startswith(("--histogram=", "--histofall=")):
            value = word.split("=", 1)[1]
        elif word in ("--histogram", "--histofall", "-h", "-H"):
            value = nxt
        elif len(word) > 2 and word[:2] in ("-h", "-H") and word[2:].isdigit():
            value = word[2:]
        if value is not None and value.isdigit():
            size = int(value)
    return size, nsecs


# cyclictest writes a thread without a cycle's average as "avg": -nan, which is not JSON;
# read such a value as null (the thread's 0 cycles then say what happened).
_NAN = re.compile(r":(\s*)-?nan")


def _load_doc(doc, tool="cyclictest"):
    if isinstance(doc, (bytes, bytearray)):
        doc = doc.decode("utf-8", "replace")
    if isinstance(doc, str):
        if not doc.strip():
            raise PostcheckError(
                "the %s JSON is empty: %s did not finish (was it killed, or "
                "was --json=FILE pointing somewhere else?)" % (tool, tool)
            )
        try:
            doc = json.loads(_NAN.sub(r":\1null", doc))
        except ValueError as exc:
            raise PostcheckError(
                "not valid JSON from %s --json (%s): capture the whole file" % (tool, exc)
            ) from None
    if not isinstance(doc, dict):
        raise PostcheckError(
            "expected the %s --json document (a JSON object), got %s" % (tool, type(doc).__name__)
        )
    return _plain_keys(doc)


def _int(value, what):
    try:
        return int(value)
    except (TypeError, ValueError):
        raise PostcheckError("%s is %r, expected a whole number" % (what, value)) from None


def _percentile(buckets, total, hist_sum, num, den):
    """Nearest-rank percentile from sorted [(latency, count)]: (value, beyond)."""
    rank = -(-total * num // den)  # ceil(total * num / den) in integers
    if rank > hist_sum:
        return None, True
    seen = 0
    for latency, count in buckets:
        seen += count
        if seen >= rank:
            return latency, False
    return None, True  # unreachable: rank <= hist_sum


def _thread_row(key, thread, hist_enabled):
    what = "thread %s" % key
    if not isinstance(thread, dict):
        raise PostcheckError("%s is not an object in the cyclictest JSON" % what)
    for field in ("cycles", "min", "max", "avg"):
        if field not in thread:
            raise PostcheckError(
                "%s has no %r: this is not cyclictest --json output (rt-tests >= 2.0)"
                % (what, field)
            )
    cycles = _int(thread["cycles"], what + " cycles")
    if cycles <= 0:
        where = " (CPU %s)" % thread["cpu"] if thread.get("cpu") not in (None, -1) else ""
        raise PostcheckError(
            "%s%s ran 0 cycles: its CPU never let it run, or cyclictest stopped before its "
            "first interval; run it longer (--duration), check that it could take its "
            "priority (--priority needs root) and what else runs there" % (what, where)
        )
    raw_hist = thread.get("histogram") or {}
    if not isinstance(raw_hist, dict):
        raise PostcheckError("%s histogram is not an object of {latency_us: count}" % what)
    buckets = sorted(
        (_int(k, what + " histogram bucket"), _int(v, what + " histogram count"))
        for k, v in raw_hist.items()
    )
    buckets = [(latency, count) for latency, count in buckets if count > 0]
    hist_sum = sum(count for _latency, count in buckets)
    cpu = thread.get("cpu")
    cpu = _int(cpu, what + " cpu") if cpu is not None else None
    row = {
        "thread": _int(key, "thread id"),
        "cpu": cpu if cpu is not None and cpu >= 0 else None,  # -1: not pinned
        "node": thread.get("node"),
        "cycles": max(cycles, hist_sum),
        "min_us": _int(thread["min"], what + " min"),
        "avg_us": float(thread["avg"]),
        "max_us": _int(thread["max"], what + " max"),
        "histogram": [[latency, count] for latency, count in buckets] if hist_enabled else None,
        "overflows": max(0, cycles - hist_sum) if hist_enabled else None,
    }
    for name, num, den in PERCENTILES:
        if hist_enabled:
            value, beyond = _percentile(buckets, row["cycles"], hist_sum, num, den)
        else:
            value, beyond = None, False
        row[name + "_us"] = value
        row[name + "_beyond_histogram"] = beyond
    return row


def _worst(rows, name):
    """Worst percentile over rows: beyond-the-histogram beats any number."""
    worst = None
    for row in rows:
        beyond = row[name + "_beyond_histogram"]
        value = row[name + "_us"]
        if beyond:
            if worst is None or not worst[1]:
                worst = (None, True, row["cpu"])
        elif value is not None and (worst is None or (not worst[1] and value > worst[0])):
            worst = (value, False, row["cpu"])
    return worst or (None, False, None)


def parse_cyclictest(doc):
    """Per-CPU rows and a summary from a ``cyclictest --json`` document (dict or str).

    Returns ``{"summary": {...}, "cpus": [row, ...]}``; a row has ``thread``, ``cpu``
    (None when unpinned), ``node``, ``cycles``, ``min_us``, ``avg_us``, ``max_us``,
    ``histogram`` (``[[latency_us, count], ...]`` or None without ``--histogram``),
    ``overflows`` (cycles beyond the histogram), and ``p99_us``/``p999_us`` with
    ``p99_beyond_histogram``/``p999_beyond_histogram`` (value None when beyond).
    """
    doc = _load_doc(doc)
    if "thread" not in doc and "return_code" not in doc:
        raise PostcheckError(
            "no 'thread' or 'return_code' key: this is not cyclictest --json output "
            "(keys: %s)" % ", ".join(sorted(doc)[:8])
        )
    return_code = doc.get("return_code", 0)
    if return_code not in (0, None):
        raise PostcheckError(
            "cyclictest exited with return code %s: the run failed on the host (the "
            "post-check log has its stderr); fix that and run the post-check again" % return_code
        )
    threads = doc.get("thread")
    if not isinstance(threads, dict) or not threads:
        raise PostcheckError(
            "the cyclictest JSON has no measurement threads ('thread' is empty): run "
            "cyclictest with --threads and -a <isolated cpus>"
        )
    cmdline = str(doc.get("cmdline") or "")
    hist_size, nsecs = _histogram_option(cmdline)
    if nsecs:
        raise PostcheckError(
            "cyclictest ran with --nsecs: its numbers are nanoseconds; run it without -N so "
            "latencies and the histogram are in microseconds"
        )
    if cmdline:
        hist_enabled = hist_size is not None
    else:  # an older file without its command line: trust what the threads carry
        hist_enabled = any(isinstance(t, dict) and t.get("histogram") for t in threads.values())
    ids = sorted(_int(key, "thread id") for key in threads)
    rows = [
        _thread_row(i, threads[str(i)] if str(i) in threads else threads[i], hist_enabled)
        for i in ids
    ]
    sysinfo = doc.get("sysinfo") if isinstance(doc.get("sysinfo"), dict) else {}
    worst_max = max(rows, key=lambda r: r["max_us"])
    summary = {
        "version": doc.get("rt_test_version"),
        "cmdline": cmdline,
        "start_time": doc.get("start_time"),
        "end_time": doc.get("end_time"),
        "kernel_release": sysinfo.get("release"),
        "realtime": bool(sysinfo.get("realtime")),
        "threads": len(rows),
        "cpus": format_cpulist(r["cpu"] for r in rows if r["cpu"] is not None),
        "histogram_us": hist_size if hist_enabled else None,
        "cycles": sum(r["cycles"] for r in rows),
        "min_cycles": min(r["cycles"] for r in rows),
        "overflows": sum(r["overflows"] for r in rows) if hist_enabled else None,
        "max_us": worst_max["max_us"],
        "max_cpu": worst_max["cpu"],
    }
    return {"summary": _with_worst_percentiles(summary, rows), "cpus": rows}


def format_percentile(entry, name, histogram_us=None):
    """ "42", "≥ 200" (beyond the histogram) or "n/a" for ``entry[name + '_us']``."""
    if entry.get(name + "_beyond_histogram"):
        size = histogram_us if histogram_us is not None else entry.get("histogram_us")
        return "≥ %s" % size if size is not None else "beyond histogram"
    value = entry.get(name + "_us")
    return "n/a" if value is None else str(value)


def _with_worst_percentiles(summary, rows):
    """``summary`` with the worst p99/p99.9 over rows (value, beyond, CPU) added."""
    for name, _fraction, _label in PERCENTILES:
        value, beyond, cpu = _worst(rows, name)
        summary[name + "_us"] = value
        summary[name + "_beyond_histogram"] = beyond
        summary[name + "_cpu"] = cpu
    return summary


# --------------------------------------------------------------------------- oslat

# oslat (rt-tests) busy-loops on each measured CPU the way a polling data-plane or
# inference thread does, and counts every gap in the loop in 1 µs buckets. Its JSON
# (``oslat --json=FILE``) has per thread ``cpu``, ``min``/``avg``/``max`` (µs),
# ``duration`` (s) and ``histogram`` {"1": n, ..., "B": n}: bucket k < B counts loops of
# k µs (rounded up), the last bucket B (``--bucket-size``, default 32) also counts every
# longer one ("including overflows" in its text output), so a percentile that falls in
# it is a bound (>= B µs), never a number.


def _oslat_row(key, thread):
    what = "oslat thread %s" % key
    if not isinstance(thread, dict):
        raise PostcheckError("%s is not an object in the oslat JSON" % what)
    for field in ("cpu", "min", "avg", "max", "histogram"):
        if field not in thread:
            raise PostcheckError(
                "%s has no %r: this is not oslat --json output (rt-tests >= 2.2)" % (what, field)
            )
    raw_hist = thread["histogram"]
    if not isinstance(raw_hist, dict) or not raw_hist:
        raise PostcheckError("%s histogram is not an object of {latency_us: count}" % what)
    buckets = sorted(
        (_int(k, what + " histogram bucket"), _int(v, what + " histogram count"))
        for k, v in raw_hist.items()
    )
    if any(count < 0 for _latency, count in buckets):
        raise PostcheckError("%s histogram has a negative count" % what)
    last_us = buckets[-1][0]
    loops = sum(count for _latency, count in buckets)
    if loops <= 0:
        raise PostcheckError(
            "%s counted no loops: oslat stopped before measuring; run it longer (--duration)" % what
        )
    # The last bucket is open-ended: a rank that lands there is ">= last_us".
    below = [(latency, count) for latency, count in buckets[:-1] if count > 0]
    below_sum = sum(count for _latency, count in below)
    row = {
        "thread": _int(key, "oslat thread id"),
        "cpu": _int(thread["cpu"], what + " cpu"),
        "loops": loops,
        "duration_s": float(thread.get("duration") or 0.0),
        "min_us": _int(thread["min"], what + " min"),
        "avg_us": float(thread["avg"]),
        "max_us": _int(thread["max"], what + " max"),
        "histogram": [[latency, count] for latency, count in buckets if count > 0],
        "bucket_us": last_us,
        "overflows": buckets[-1][1],
    }
    for name, num, den in PERCENTILES:
        row[name + "_us"], row[name + "_beyond_histogram"] = _percentile(
            below, loops, below_sum, num, den
        )
    return row


def parse_oslat(doc):
    """Per-CPU rows and a summary from an ``oslat --json`` document (dict or str).

    Returns ``{"summary": {...}, "cpus": [row, ...]}``; a row has ``thread``, ``cpu``,
    ``loops``, ``duration_s``, ``min_us``/``avg_us``/``max_us``, ``histogram``
    (``[[latency_us, count], ...]``, the last bucket open-ended), ``bucket_us`` (that last
    bucket), ``overflows`` (its count) and ``p99_us``/``p999_us`` with
    ``*_beyond_histogram`` (value None when the rank falls in the open last bucket).
    """
    doc = _load_doc(doc, "oslat")
    if "thread" not in doc or "num_threads" not in doc:
        raise PostcheckError(
            "no 'thread' or 'num_threads' key: this is not oslat --json output (keys: %s)"
            % ", ".join(sorted(doc)[:8])
        )
    if doc.get("return_code", 0) not in (0, None):
        raise PostcheckError(
            "oslat exited with return code %s: the run failed on the host (the post-check log "
            "has its stderr); fix that and run the post-check again" % doc.get("return_code")
        )
    threads = doc["thread"]
    if not isinstance(threads, dict) or not threads:
        raise PostcheckError(
            "the oslat JSON has no measurement threads: run oslat with --cpu-list <cpus>"
        )
    ids = sorted(_int(key, "oslat thread id") for key in threads)
    rows = [_oslat_row(i, threads[str(i)] if str(i) in threads else threads[i]) for i in ids]
    sysinfo = doc.get("sysinfo") if isinstance(doc.get("sysinfo"), dict) else {}
    worst = max(rows, key=lambda r: r["max_us"])
    summary = {
        "version": doc.get("rt_test_version"),
        "cmdline": str(doc.get("cmdline") or ""),
        "start_time": doc.get("start_time"),
        "end_time": doc.get("end_time"),
        "kernel_release": sysinfo.get("release"),
        "realtime": bool(sysinfo.get("realtime")),
        "threads": len(rows),
        "cpus": format_cpulist(r["cpu"] for r in rows),
        "bucket_us": max(r["bucket_us"] for r in rows),
        "loops": sum(r["loops"] for r in rows),
        "duration_s": min(r["duration_s"] for r in rows),
        "max_us": worst["max_us"],
        "max_cpu": worst["cpu"],
    }
    return {"summary": _with_worst_percentiles(summary, rows), "cpus": rows}


# --------------------------------------------------------------------------- hwlatdetect

# hwlatdetect (rt-tests) drives the kernel's hwlat tracer: a kernel thread spins with
# interrupts off on one CPU at a time (``width`` µs of every ``window``) and records any gap
# in the TSC it reads, which only the hardware or firmware can cause (SMIs, power
# management). It prints its parameters, "test finished", then "Max Latency: <n>us" (or
# "Below threshold"), "Samples recorded: n", "Samples exceeding threshold: n", on Intel
# "SMIs during run: n", and one line per sample, "ts: <s.ns>, inner:<µs>, outer:<µs>".
# Its exit status is 1 both for a latency above --hardlimit and for a crash (no tracer), so
# the post-check judges the text, not the status.

_HWLAT_PARAMS = {
    "Latency threshold": "threshold_us",
    "Sample window": "window_us",
    "Sample width": "width_us",
}


def _hwlat_us(value, what):
    text = value.strip()
    if text.endswith("us"):
        text = text[:-2]
    try:
        return int(text)
    except ValueError:
        raise PostcheckError("hwlatdetect %s is %r, expected <n>us" % (what, value)) from None


def parse_hwlatdetect(text):
    """The figures of one ``hwlatdetect`` run from its standard output.

    Returns ``{"duration_s", "threshold_us", "window_us", "width_us", "max_us" (0 when
    no sample crossed the threshold), "samples": [{"ts", "inner_us", "outer_us"}],
    "exceeding", "smis" (None where the CPU has no SMI counter)}``. PostcheckError when
    the run did not finish, with the reason the tool gave.
    """
    if isinstance(text, (bytes, bytearray)):
        text = text.decode("utf-8", "replace")
    if not isinstance(text, str):
        raise PostcheckError("hwlatdetect output must be text, got %s" % type(text).__name__)
    lines = [line.strip() for line in text.splitlines()]
    out = {"duration_s": None, "samples": [], "smis": None}
    finished = False
    for line in lines:
        if line.startswith("hwlatdetect:") and "test duration" in line:
            words = line.split()
            out["duration_s"] = _int(words[words.index("duration") + 1], "hwlatdetect duration")
        elif ":" in line and line.split(":", 1)[0] in _HWLAT_PARAMS:
            key, value = line.split(":", 1)
            out[_HWLAT_PARAMS[key]] = _hwlat_us(value, key.lower())
        elif line == "test finished":
            finished = True
        elif line.startswith("Max Latency:"):
            value = line.split(":", 1)[1].strip()
            out["max_us"] = 0 if value == "Below threshold" else _hwlat_us(value, "max latency")
        elif line.startswith("Samples exceeding threshold:"):
            out["exceeding"] = _int(line.split(":", 1)[1], "hwlatdetect samples exceeding")
        elif line.startswith("SMIs during run:"):
            out["smis"] = _int(line.split(":", 1)[1], "hwlatdetect SMI count")
        elif line.startswith("ts:") and "inner:" in line and "outer:" in line:
            fields = dict(part.strip().split(":", 1) for part in line.split(",") if ":" in part)
            out["samples"].append(
                {
                    "ts": fields["ts"].strip(),
                    "inner_us": _int(fields["inner"], "hwlatdetect sample inner"),
                    "outer_us": _int(fields["outer"], "hwlatdetect sample outer"),
                }
            )
    if not finished or "max_us" not in out:
        reason = next((line for line in reversed(lines) if line), "no output")
        if "Errno 75" in reason or "Value too large" in reason:
            reason += (
                " (the kernel refused a cpumask written as one hex word, which happens for any "
                "CPU >= 32: hwlatdetect's own --cpu-list does that; the post-check's runner "
                "writes tracing_cpumask in 32-bit comma groups instead)"
            )
        elif "not available" in reason or "DetectorNotAvailable" in reason:
            reason += (
                " (the kernel has no hwlat tracer: it needs CONFIG_HWLAT_TRACER, which Debian's "
                "kernels have; or set rtfleet_postcheck_hwlatdetect: false)"
            )
        raise PostcheckError("hwlatdetect did not finish: %s" % reason)
    for key in ("threshold_us", "window_us", "width_us"):
        out.setdefault(key, None)
    out.setdefault("exceeding", len(out["samples"]))
    if out["samples"]:
        out["max_us"] = max(
            out["max_us"], *(max(s["inner_us"], s["outer_us"]) for s in out["samples"])
        )
    return out


__all__ = [
    "PERCENTILES",
    "format_percentile",
    "parse_cyclictest",
    "parse_hwlatdetect",
    "parse_oslat",
]
