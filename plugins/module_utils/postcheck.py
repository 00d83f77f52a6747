"""Post-check evaluation: read cyclictest output, gate a tuned host on it.

Stdlib-only and Python >= 3.9, like :mod:`rtfleet.topology`: the Ansible filters
(``rtfleet_cyclictest``, ``rtfleet_postcheck_gate``) call it on the controller and
``rtfleet report`` calls it for the whole fleet, so a host's verdict comes from one
computation.

Per-host result file
====================

The post-check role writes one JSON file per host on the controller,
``<results_dir>/<host>.json``. Schema 1::

    {
      "schema": 1,
      "host": "epyc1",                      # inventory hostname
      "kind": "tuned" | "baseline",         # baseline: captured on the old VM before migration
      "collected_at": "2026-11-30T13:00:00Z",
      "virtualization": "none" | "kvm" | "qemu" | ...,   # systemd-detect-virt; qemu = TCG
      "kernel": {"release": str, "realtime": bool, "cmdline": str},
      "plan": {                             # {} for a baseline host
        "housekeeping": "0,4",
        "isolated": "1-3,5-7",
        "runtime_groups": {"ccx0": "1-3", "ccx1": "5-7"}
      },
      "hwlatdetect": {                      # run first; or {"skipped": reason}, or null
        "output": "...",                    # hwlatdetect's standard output
        "cpus": "1-3,5-7", "duration_s": 300, "window_us": 1000000, "width_us": 500000
      },
      "cyclictest": {                       # or {"skipped": reason}, or null (not run)
        "json": {...},                      # the raw `cyclictest --json=FILE` document
        "load": "hackbench ...",            # the background load during the run
        "duration_s": 60,
        "cpus": "1-3,5-7"                   # the -a cpulist
      },
      "oslat": {                            # after cyclictest; or {"skipped": reason}, or null
        "json": {...},                      # the raw `oslat --json=FILE` document
        "load": "...", "duration_s": 300, "cpus": "1-3,5-7", "priority": 1
      },
      "smoke": [{...}],                     # `shminfer smoke --format json` per unit; may be []
                                            # plus "client_cpu" (the CPU the role pinned the
                                            # client to) and "client_cpu_from" (why there);
                                            # shminfer records "client_cpus", its affinity
                                            # as it ran, and "latency_jitter" (std / mean)
      "consistency": [{"check": str, "ok": bool, "detail": str}],
      "thresholds": {                       # the limits this run was gated with
        "cyclictest_max_us": 100,           # -> gate_cyclictest max_us
        "cyclictest_p999_us": 50,           # optional -> p999_us
        "cyclictest_min_cycles": 10000,     # optional -> min_cycles
        "hwlatdetect_max_us": 20,           # -> gate_hwlatdetect (default 20)
        "oslat_max_us": 100,                # -> gate_oslat (default: cyclictest_max_us)
        "smoke_max_jitter": 0.2,            # -> gate_smoke (default 0.20; null = off)
        "smoke_max_p99_ms": 5.0, ...        # informational: shminfer smoke gates itself
      },
      "gate": {"passed": bool, "verdict": "passed" | "hardware/firmware" | "failed",
               "failures": [str, ...]}      # gate_host(result), as the role saw it
    }

Required: ``schema``, ``host``, ``kind``; every other key may be missing and then reads
as empty (``{}``, ``[]`` or ``null``). :func:`validate_result` says what is wrong.

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

from .cpulist import TopologyError, format_cpulist, parse_cpulist

SCHEMA_VERSION = 1
KINDS = ("tuned", "baseline")

# Why these defaults (docs/report.md has the longer version):
# - max_us 100: a tuned PREEMPT_RT x86 host under load keeps cyclictest's worst case in
#   the tens of microseconds (rt-tests README shows 18-22 us against 39 ms on a non-RT
#   kernel; OSADL's QA farm and Red Hat's RT tuning guide judge hosts on this same
#   worst-case number), so 100 us is a conservative bar a tuned host should clear.
# - min_cycles 10000: 10 s at the default 1 ms interval. Fewer, and p99.9 rests on under
#   ten samples; the rt-tests README and Red Hat's guide both warn that short runs say
#   little about the worst case.
# - p999_us: off unless the inventory sets it; the worst case is the contract.
DEFAULT_THRESHOLDS = {"max_us": 100, "p999_us": None, "min_cycles": 10000}

# (name, numerator, denominator): integer ranks, no float rounding at the boundary.
PERCENTILES = (("p99", 99, 100), ("p999", 999, 1000))

# How many CPUs a failure message names before it says "and N more".
_NAMED_CPUS = 8


class PostcheckError(Exception):
    """Malformed post-check input; the message says what to fix."""


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


def _cpu_label(row):
    return "CPU %d" % row["cpu"] if row["cpu"] is not None else "thread %d" % row["thread"]


def _named(rows, value_text):
    shown = ", ".join("%s %s" % (_cpu_label(r), value_text(r)) for r in rows[:_NAMED_CPUS])
    if len(rows) > _NAMED_CPUS:
        shown += " and %d more" % (len(rows) - _NAMED_CPUS)
    return shown


def _as_parsed(parsed):
    if isinstance(parsed, dict) and "summary" in parsed and "cpus" in parsed:
        return parsed
    return parse_cyclictest(parsed)


def _limits(thresholds):
    thresholds = dict(thresholds or {})
    unknown = sorted(set(thresholds) - set(DEFAULT_THRESHOLDS))
    if unknown:
        raise PostcheckError(
            "unknown cyclictest threshold(s) %s: known are %s"
            % (", ".join(unknown), ", ".join(sorted(DEFAULT_THRESHOLDS)))
        )
    limits = dict(DEFAULT_THRESHOLDS)
    limits.update(thresholds)
    for key, value in limits.items():
        limits[key] = _number(value, "cyclictest threshold " + key)
    return limits


def _number(value, what):
    # Ansible templating can hand numbers over as strings ("100").
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return value
    try:
        return float(value) if "." in str(value) else int(value)
    except (TypeError, ValueError):
        raise PostcheckError("%s is %r, expected a number" % (what, value)) from None


def _max_over(tool, rows, limit):
    """The failure, if any, of rows whose worst case (``max_us``) is over ``limit``."""
    if limit is None:
        return []
    over = sorted((r for r in rows if r["max_us"] > limit), key=lambda r: -r["max_us"])
    if not over:
        return []
    return [
        "%s max latency %d µs on %s exceeds the %s µs limit (%d of %d CPUs over: %s)"
        % (
            tool,
            over[0]["max_us"],
            _cpu_label(over[0]),
            _num(limit),
            len(over),
            len(rows),
            _named(over, lambda r: "%d µs" % r["max_us"]),
        )
    ]


def _with_worst_percentiles(summary, rows):
    """``summary`` with the worst p99/p99.9 over rows (value, beyond, CPU) added."""
    for name, _fraction, _label in PERCENTILES:
        value, beyond, cpu = _worst(rows, name)
        summary[name + "_us"] = value
        summary[name + "_beyond_histogram"] = beyond
        summary[name + "_cpu"] = cpu
    return summary


def gate_cyclictest(parsed, thresholds=None):
    """Failure messages (empty when the run passes) for a :func:`parse_cyclictest` result.

    ``parsed`` may also be the raw cyclictest document. ``thresholds``: ``max_us``
    (default 100), ``p999_us`` (default off), ``min_cycles`` (default 10000); a None value
    switches that check off. Each message names the value, the limit and the CPUs.
    """
    parsed = _as_parsed(parsed)
    limits = _limits(thresholds)
    rows = parsed["cpus"]
    hist_us = parsed["summary"]["histogram_us"]
    failures = []

    min_cycles = limits["min_cycles"]
    if min_cycles is not None:
        short = sorted((r for r in rows if r["cycles"] < min_cycles), key=lambda r: r["cycles"])
        if short:
            failures.append(
                "cyclictest ran only %d cycles on %s, fewer than the %s minimum (%d of %d CPUs "
                "short: %s): run it longer (--duration) so the worst case means something"
                % (
                    short[0]["cycles"],
                    _cpu_label(short[0]),
                    _num(min_cycles),
                    len(short),
                    len(rows),
                    _named(short, lambda r: "%d" % r["cycles"]),
                )
            )

    failures.extend(_max_over("cyclictest", rows, limits["max_us"]))

    p999_limit = limits["p999_us"]
    if p999_limit is not None:
        if hist_us is None:
            failures.append(
                "cyclictest ran without --histogram, so p99.9 cannot be checked against the "
                "%s µs limit: add --histogram=<µs above the limit>" % _num(p999_limit)
            )
        else:
            # Beyond the histogram means >= hist_us: over the limit for sure only when
            # hist_us > limit; otherwise the run cannot tell, which fails too.
            over = [
                r
                for r in rows
                if (r["p999_beyond_histogram"] and hist_us > p999_limit)
                or (r["p999_us"] is not None and r["p999_us"] > p999_limit)
            ]
            unknown = [r for r in rows if r["p999_beyond_histogram"] and hist_us <= p999_limit]
            over.sort(key=lambda r: -(r["p999_us"] if r["p999_us"] is not None else hist_us))
            if over:
                failures.append(
                    "cyclictest p99.9 latency %s µs on %s exceeds the %s µs limit (%d of %d CPUs "
                    "over: %s)"
                    % (
                        format_percentile(over[0], "p999", hist_us),
                        _cpu_label(over[0]),
                        _num(p999_limit),
                        len(over),
                        len(rows),
                        _named(over, lambda r: format_percentile(r, "p999", hist_us) + " µs"),
                    )
                )
            if unknown:
                failures.append(
                    "cyclictest p99.9 on %s lies beyond the %d µs histogram, so the %s µs "
                    "limit cannot be checked: rerun with --histogram above the limit"
                    % (
                        _named(unknown, lambda r: "(%d overflows)" % r["overflows"]),
                        hist_us,
                        _num(p999_limit),
                    )
                )
    return failures


def _num(value):
    return "%g" % value


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


def gate_oslat(parsed, max_us, wanted_cpus=None):
    """Failure messages for a :func:`parse_oslat` result (or the raw document).

    ``max_us``: the worst loop gap allowed on any CPU (None: not checked); ``wanted_cpus``:
    the cpulist the post-check asked oslat to measure (every one must have a thread).
    """
    if not (isinstance(parsed, dict) and "summary" in parsed and "cpus" in parsed):
        parsed = parse_oslat(parsed)
    rows = parsed["cpus"]
    failures = _measured_cpus("oslat", rows, wanted_cpus, "pass --cpu-list <cpus>")
    failures.extend(_max_over("oslat", rows, _number(max_us, "oslat threshold max_us")))
    return failures


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


def gate_hwlatdetect(parsed, max_us):
    """Failure messages for a :func:`parse_hwlatdetect` result (or its text).

    A failure here is the hardware's or the firmware's: no OS tuning removes it, so the
    post-check stops the host before cyclictest, oslat and the smoke test.
    """
    if not isinstance(parsed, dict):
        parsed = parse_hwlatdetect(parsed)
    limit = _number(max_us, "hwlatdetect threshold max_us")
    if limit is None:
        return []
    threshold = parsed.get("threshold_us")
    if threshold is not None and threshold > limit:
        return [
            "hwlatdetect ran with --threshold %d µs, above the %s µs limit, so a gap between "
            "the two would go unseen: run it with --threshold <= the limit"
            % (threshold, _num(limit))
        ]
    if parsed["max_us"] <= limit:
        return []
    smis = parsed.get("smis")
    return [
        "hwlatdetect: hardware/firmware latency %d µs exceeds the %s µs limit (%d samples over "
        "%s; %s): no OS tuning removes this; check the BIOS checklist (C-states, power and "
        "SMI sources, firmware updates) before tuning further"
        % (
            parsed["max_us"],
            _num(limit),
            parsed.get("exceeding") or len(parsed["samples"]),
            "%s s" % parsed["duration_s"] if parsed.get("duration_s") else "the run",
            "%d SMIs during the run" % smis if smis is not None else "no SMI counter on this CPU",
        )
    ]


# --------------------------------------------------------------------------- host result


def _fail(source, message):
    raise PostcheckError("%s: %s" % (source, message))


def validate_result(result, source="<result>"):
    """A copy of a per-host result with optional keys filled in; PostcheckError if malformed."""
    if not isinstance(result, dict):
        _fail(source, "a post-check result is a JSON object, got %s" % type(result).__name__)
    schema = result.get("schema")
    if schema != SCHEMA_VERSION:
        _fail(
            source,
            "schema %r is not supported: this rtfleet reads schema %d (run the post-check role "
            "of the same rtfleet version)" % (schema, SCHEMA_VERSION),
        )
    host = result.get("host")
    if not isinstance(host, str) or not host.strip():
        _fail(source, "'host' must be the inventory hostname (a non-empty string)")
    if result.get("kind") not in KINDS:
        _fail(source, "'kind' is %r, expected one of %s" % (result.get("kind"), ", ".join(KINDS)))
    out = dict(result)
    for key, empty, kind in (
        ("kernel", {}, dict),
        ("plan", {}, dict),
        ("smoke", [], list),
        ("consistency", [], list),
        ("thresholds", {}, dict),
    ):
        value = out.get(key)
        if value is None:
            out[key] = type(empty)()
        elif not isinstance(value, kind):
            _fail(source, "%r must be a %s, got %s" % (key, kind.__name__, type(value).__name__))
    virt = out.get("virtualization")
    if virt is not None and not isinstance(virt, str):
        _fail(source, "'virtualization' must be systemd-detect-virt's word or null")
    out["virtualization"] = virt
    out.setdefault("collected_at", None)
    out.setdefault("gate", None)
    cyclictest = out.get("cyclictest")
    if cyclictest is not None and (
        not isinstance(cyclictest, dict)
        or ("json" not in cyclictest and "skipped" not in cyclictest)
    ):
        _fail(
            source,
            "'cyclictest' must be null, {'skipped': reason} or an object with the raw document "
            "under 'json'",
        )
    out["cyclictest"] = cyclictest
    for tool, raw in (("hwlatdetect", "output"), ("oslat", "json")):
        entry = out.get(tool)
        if entry is not None and (
            not isinstance(entry, dict) or (raw not in entry and "skipped" not in entry)
        ):
            _fail(
                source,
                "%r must be null, {'skipped': reason} or an object with the tool's raw %s under "
                "%r" % (tool, "output" if raw == "output" else "document", raw),
            )
        out[tool] = entry
    for i, entry in enumerate(out["smoke"]):
        if not isinstance(entry, dict) or "server" not in entry:
            _fail(
                source, "smoke[%d] is not `shminfer smoke --format json` output (no 'server')" % i
            )
        if not isinstance(entry.get("failures", []), list):
            _fail(source, "smoke[%d].failures must be a list of strings" % i)
    for i, entry in enumerate(out["consistency"]):
        if not isinstance(entry, dict) or "check" not in entry or "ok" not in entry:
            _fail(source, "consistency[%d] needs 'check' and 'ok'" % i)
    for key, value in out["thresholds"].items():
        if value is not None and not isinstance(value, (int, float, str, bool)):
            _fail(source, "threshold %r is %r, expected a number" % (key, value))
    return out


def load_result(path):
    """Read and validate one ``<host>.json`` result file."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except OSError as exc:
        raise PostcheckError("%s: cannot read the result (%s)" % (path, exc.strerror)) from None
    except ValueError as exc:
        raise PostcheckError("%s: not valid JSON (%s)" % (path, exc)) from None
    return validate_result(data, str(path))


def cyclictest_thresholds(thresholds):
    """The ``cyclictest_*`` keys of a host's thresholds, as :func:`gate_cyclictest` keys."""
    prefix = "cyclictest_"
    return {
        key[len(prefix) :]: value
        for key, value in (thresholds or {}).items()
        if key.startswith(prefix) and key[len(prefix) :] in DEFAULT_THRESHOLDS
    }


def _measured_cpus(tool, rows, wanted, hint):
    """A failure when ``tool`` measured other CPUs than the post-check asked for."""
    if not wanted:
        return []
    try:
        wanted_cpus = parse_cpulist(str(wanted), tool + ".cpus")
    except TopologyError as exc:
        raise PostcheckError(str(exc)) from None
    measured = sorted({r["cpu"] for r in rows if r["cpu"] is not None})
    if measured == wanted_cpus:
        return []
    missing = format_cpulist(set(wanted_cpus) - set(measured))
    return [
        "%s measured CPUs %s but the post-check asked for %s%s: %s so every isolated CPU "
        "gets a measuring thread"
        % (
            tool,
            format_cpulist(measured) or "(none pinned)",
            format_cpulist(wanted_cpus),
            " (not measured: %s)" % missing if missing else "",
            hint,
        )
    ]


def _coverage(parsed, wanted):
    return _measured_cpus("cyclictest", parsed["cpus"], wanted, "pass -a <cpus> with --threads")


# --------------------------------------------------------------------------- settings

# The post-check's own settings, by role variable: (kind, lower bound, allow None).
# check_settings() refuses bad values before anything runs on a host.
SETTINGS = {
    "rtfleet_postcheck_hwlatdetect_duration": ("seconds", 1, False),
    "rtfleet_postcheck_duration": ("seconds", 1, False),
    "rtfleet_postcheck_oslat_duration": ("seconds", 1, False),
    "rtfleet_postcheck_long_run_s": ("seconds", 0, False),
    "rtfleet_postcheck_hwlatdetect_max_us": ("us", 1, False),
    "rtfleet_postcheck_hwlatdetect_threshold_us": ("us", 1, False),
    "rtfleet_postcheck_hwlatdetect_window_us": ("us", 2, False),
    "rtfleet_postcheck_hwlatdetect_width_us": ("us", 1, False),
    "rtfleet_postcheck_cyclictest_max_us": ("us", 1, True),
    "rtfleet_postcheck_cyclictest_p999_us": ("us", 1, True),
    "rtfleet_postcheck_cyclictest_min_cycles": ("count", 0, True),
    "rtfleet_postcheck_interval_us": ("us", 1, False),
    "rtfleet_postcheck_histogram_us": ("us", 1, False),
    "rtfleet_postcheck_priority": ("priority", 1, False),
    "rtfleet_postcheck_oslat_max_us": ("us", 1, True),
    "rtfleet_postcheck_oslat_priority": ("priority", 0, False),
    "rtfleet_postcheck_oslat_bucket_size": ("buckets", 4, False),
    "rtfleet_postcheck_smoke_max_jitter": ("ratio", 0, True),
}
_UPPER = {"priority": 99, "buckets": 1024}
_SETTING_HINT = {
    "seconds": "a whole number of seconds",
    "us": "a whole number of microseconds",
    "count": "a whole number",
    "priority": "a SCHED_FIFO priority",
    "buckets": "oslat's bucket count (--bucket-size)",
    "ratio": "a number (standard deviation / mean)",
}


def check_settings(settings):
    """One-line errors, each naming its variable, for the post-check's settings.

    ``settings`` maps role variable names (:data:`SETTINGS`) to their values as Ansible
    hands them over (numbers or numeric strings; None where a gate may be off). Unknown
    names are an error too (a misspelt variable would otherwise be ignored).
    """
    errors = []
    for name, value in (settings or {}).items():
        if name not in SETTINGS:
            errors.append("%s is not a post-check setting this rtfleet knows" % name)
            continue
        kind, low, nullable = SETTINGS[name]
        high = _UPPER.get(kind)
        hint = _SETTING_HINT[kind]
        if value is None or (isinstance(value, str) and not value.strip()):
            if not nullable:
                errors.append("%s is empty: give %s" % (name, hint))
            continue
        try:
            if isinstance(value, bool):
                raise ValueError
            number = float(value) if kind == "ratio" else int(str(value).strip())
        except (TypeError, ValueError):
            errors.append("%s is %r: give %s" % (name, value, hint))
            continue
        if number < low or (high is not None and number > high):
            bound = "%s to %s" % (low, high) if high is not None else "at least %s" % low
            errors.append("%s is %s: give %s, %s" % (name, value, hint, bound))
    limit = settings.get("rtfleet_postcheck_hwlatdetect_max_us")
    threshold = settings.get("rtfleet_postcheck_hwlatdetect_threshold_us")
    try:
        if limit is not None and threshold is not None and int(threshold) > int(limit):
            errors.append(
                "rtfleet_postcheck_hwlatdetect_threshold_us (%s) must not be above "
                "rtfleet_postcheck_hwlatdetect_max_us (%s): a gap between the two would go "
                "unrecorded" % (threshold, limit)
            )
    except (TypeError, ValueError):
        pass  # reported above
    window = settings.get("rtfleet_postcheck_hwlatdetect_window_us")
    width = settings.get("rtfleet_postcheck_hwlatdetect_width_us")
    try:
        if window is not None and width is not None and int(width) >= int(window):
            errors.append(
                "rtfleet_postcheck_hwlatdetect_width_us (%s) must be below "
                "rtfleet_postcheck_hwlatdetect_window_us (%s): the tracer spins width µs of "
                "every window" % (width, window)
            )
    except (TypeError, ValueError):
        pass  # reported above
    return errors


# The smoke round trip's jitter coefficient (standard deviation / mean) when the inventory
# sets no rtfleet_postcheck_smoke_max_jitter. From the field report on Kubernetes CPU
# Manager pinning (roles/rtfleet_postcheck/README.md cites it): 4 inference cores on shared
# CFS time slices 0.35, pinned 0.18, pinned with the inference threads capped 0.15, pinned
# on one NUMA node 0.12; its advice is to look at thread affinity and NUMA placement above
# 0.20. 0.20 passes every pinned figure and fails the shared-core one.
DEFAULT_SMOKE_MAX_JITTER = 0.2

# Gates of the trio when the inventory sets none (docs/report.md gives the sources):
# hwlatdetect 20 µs, OpenShift cnf-tests' default (HWLATDETECT_MAXIMUM_LATENCY; the tool's
# own default threshold is 10 µs); oslat: the cyclictest limit, like OpenShift's one
# MAXIMUM_LATENCY for every tool that a tool-specific value overrides.
DEFAULT_HWLATDETECT_MAX_US = 20

VERDICTS = ("passed", "hardware/firmware", "failed")


def hardware_gate(result):
    """``(parsed or None, failures)`` of a result's hwlatdetect run alone.

    The post-check calls this before anything else runs: a failure here means the host's
    hardware or firmware stalls the CPUs, and cyclictest, oslat and the smoke test are
    skipped (OpenShift's order: hwlatdetect first, since OS tuning cannot fix hardware).
    """
    source = result.get("host") if isinstance(result, dict) else None
    result = validate_result(result, str(source or "<result>"))
    entry = result.get("hwlatdetect")
    if entry is None:
        if result["kind"] == "tuned":
            return None, [
                "no hwlatdetect run recorded: the post-check runs it first on a tuned host "
                "(rtfleet_postcheck_hwlatdetect: false records a skip instead)"
            ]
        return None, []
    if "skipped" in entry:
        return None, []
    try:
        parsed = parse_hwlatdetect(entry["output"])
    except PostcheckError as exc:
        return None, [str(exc)]
    limit = result["thresholds"].get("hwlatdetect_max_us", DEFAULT_HWLATDETECT_MAX_US)
    try:
        return parsed, gate_hwlatdetect(parsed, limit)
    except PostcheckError as exc:
        return parsed, ["hwlatdetect: %s" % exc]


def _gate_off(value):
    """A threshold switched off: null in the inventory (Ansible may hand it over as text)."""
    return value is None or str(value).strip() in ("", "None", "none", "null")


def smoke_client_placement(entry):
    """The failure, if any, of a smoke client that ran elsewhere than the role pinned it."""
    asked, ran = entry.get("client_cpu"), entry.get("client_cpus")
    if asked is None or ran is None:
        return []  # not pinned (a sampler's run), or a shminfer that did not record it
    try:
        asked_cpus = parse_cpulist(str(asked), "client_cpu")
        ran_cpus = parse_cpulist(str(ran), "client_cpus")
    except TopologyError as exc:
        return ["the smoke client's CPUs cannot be read: %s" % exc]
    if ran_cpus == asked_cpus:
        return []
    return [
        "the client ran on CPUs %s, not on CPU %s where the post-check pinned it (the cgroup's "
        "cpuset or the affinity did not take): the round trip was not measured where the "
        "unit's samplers run" % (format_cpulist(ran_cpus) or "(none)", format_cpulist(asked_cpus))
    ]


def gate_smoke(entry, thresholds=None):
    """Failure messages (without the unit's name) for one ``shminfer smoke`` entry.

    shminfer smoke gates its own figures (``failures``) with the limits the role passed it;
    this adds what the post-check judges itself: the round trip's jitter coefficient
    (``latency_jitter``, standard deviation / mean) against ``smoke_max_jitter`` (default
    :data:`DEFAULT_SMOKE_MAX_JITTER`; null switches it off) and the client's affinity as it
    ran (``client_cpus``) against the CPU the role pinned it to (``client_cpu``).
    """
    thresholds = thresholds or {}
    own = [str(f) for f in entry.get("failures") or []]
    failures = list(own)
    if entry.get("passed") is False and not own:
        failures.append("failed without a recorded reason")
    limit = thresholds.get("smoke_max_jitter", DEFAULT_SMOKE_MAX_JITTER)
    # shminfer smoke run with --max-jitter has said so already (its own wording).
    judged = any(f.startswith("round-trip jitter") for f in own)
    if not _gate_off(limit) and not judged:
        try:
            limit = float(_number(limit, "smoke_max_jitter"))
        except PostcheckError as exc:
            failures.append(str(exc))
        else:
            jitter = entry.get("latency_jitter")
            if isinstance(jitter, bool) or not isinstance(jitter, (int, float)):
                failures.append(
                    "no round-trip jitter recorded (fewer than two answers, or a shminfer that "
                    "does not measure it), so the %g limit cannot be checked" % limit
                )
            elif jitter > limit:
                failures.append(
                    "round-trip jitter (std/mean) %.3f > %g (rtfleet_postcheck_smoke_max_jitter)"
                    % (jitter, limit)
                )
    failures.extend(smoke_client_placement(entry))
    return failures


def gate_host(result):
    """``{"passed": bool, "verdict": str, "failures": [...]}`` for one per-host result.

    In OpenShift's order: hwlatdetect (:func:`hardware_gate`; a failure makes the verdict
    "hardware/firmware", and the later tools were skipped), then :func:`gate_cyclictest`
    (limits from the ``cyclictest_*`` thresholds), :func:`gate_oslat`, each smoke entry
    (:func:`gate_smoke`: its own ``failures``, its jitter and where its client ran) and the
    failed consistency checks. A tuned host without a cyclictest run fails; a baseline may
    lack one. A tool recorded as ``{"skipped": reason}`` is not judged.
    """
    source = result.get("host") if isinstance(result, dict) else None
    result = validate_result(result, str(source or "<result>"))
    measured, hardware = hardware_gate(result)
    failures = list(hardware)
    # The hardware's fault only when hwlatdetect measured it; a run that broke is the run's.
    hardware_failed = bool(hardware) and measured is not None
    cyclictest = result["cyclictest"]
    if cyclictest is None:
        if result["kind"] == "tuned":
            failures.append("no cyclictest run recorded: the post-check must measure a tuned host")
    elif "skipped" not in cyclictest:
        try:
            parsed = parse_cyclictest(cyclictest["json"])
            failures.extend(_coverage(parsed, cyclictest.get("cpus")))
            failures.extend(gate_cyclictest(parsed, cyclictest_thresholds(result["thresholds"])))
        except PostcheckError as exc:
            failures.append("cyclictest: %s" % exc)
    oslat = result.get("oslat")
    if oslat is None:
        if result["kind"] == "tuned" and not hardware_failed:
            failures.append(
                "no oslat run recorded: the post-check runs it after cyclictest on a tuned host "
                "(rtfleet_postcheck_oslat: false records a skip instead)"
            )
    elif "skipped" not in oslat:
        limit = result["thresholds"].get(
            "oslat_max_us",
            result["thresholds"].get("cyclictest_max_us", DEFAULT_THRESHOLDS["max_us"]),
        )
        try:
            failures.extend(gate_oslat(oslat["json"], limit, oslat.get("cpus")))
        except PostcheckError as exc:
            failures.append("oslat: %s" % exc)
    for entry in result["smoke"]:
        name = entry.get("server", "?")
        failures.extend("smoke %s: %s" % (name, f) for f in gate_smoke(entry, result["thresholds"]))
    for check in result["consistency"]:
        if not check.get("ok"):
            detail = check.get("detail") or "failed"
            failures.append("consistency %s: %s" % (check.get("check"), detail))
    verdict = "hardware/firmware" if hardware_failed else "failed" if failures else "passed"
    return {"passed": not failures, "verdict": verdict, "failures": failures}


def _systemctl_show(text):
    """``systemctl show --property=...`` output (KEY=VALUE lines) -> dict."""
    shown = {}
    for line in str(text or "").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            shown[key.strip()] = value.strip()
    return shown


def _cpus(text):
    try:
        return parse_cpulist(str(text or "").strip())
    except TopologyError:
        return None


def consistency_checks(plan, observed):
    """Kernel, kubelet and units against the plan: ``[{"check", "ok", "detail"}, ...]``.

    ``plan``: /etc/rtfleet/plan.json. ``observed`` holds what the post-check read on the
    host: ``boot``, rtfleet.fleet.boot_state's result with the host record as ``wanted``
    (its ``mismatches`` and ``running``); ``kubelet``, the parsed rtfleet drop-in, or ``{}``
    when there is none, and ``kubelet_dropin``, its path; ``units``, one ``systemctl show
    --property=CPUAffinity,NUMAPolicy,NUMAMask,MainPID,ActiveState`` output per runtime
    group, in the plan's order; ``drift``, ``rtfleet-drift --check --json``'s document,
    whose ``unit_threads`` check says where every thread of every unit may run and last ran
    (the field reports' "engine threads outside the pinned range").
    """
    observed = observed if isinstance(observed, dict) else {}
    boot = observed.get("boot")
    kubelet_config = observed.get("kubelet")
    units_shown = observed.get("units")
    drift = observed.get("drift")
    kubelet_dropin = observed.get("kubelet_dropin", "the kubelet drop-in")
    if not isinstance(plan, dict) or not isinstance(plan.get("runtime_groups"), list):
        raise PostcheckError("consistency: the plan has no runtime_groups list")
    groups = plan["runtime_groups"]
    if not isinstance(units_shown, list) or len(units_shown) != len(groups):
        raise PostcheckError(
            "consistency: %s systemctl show outputs for %d runtime groups"
            % (len(units_shown) if isinstance(units_shown, list) else "no", len(groups))
        )
    boot = boot if isinstance(boot, dict) else {}
    mismatches = [str(m) for m in boot.get("mismatches") or []]
    out = [
        {
            "check": "running kernel and /proc/cmdline = host record",
            "ok": not mismatches,
            "detail": "; ".join(mismatches) or str((boot.get("running") or {}).get("release", "")),
        }
    ]
    reserved = (kubelet_config or {}).get("reservedSystemCPUs")
    planned = (plan.get("kubelet") or {}).get("reservedSystemCPUs")
    if reserved is None:
        out.append(
            {
                "check": "kubelet reservedSystemCPUs = plan",
                "ok": True,
                "detail": "skipped: no %s (kubelet role not run, or main-config mode)"
                % kubelet_dropin,
            }
        )
    else:
        out.append(
            {
                "check": "kubelet reservedSystemCPUs = plan",
                "ok": _cpus(reserved) is not None and _cpus(reserved) == _cpus(planned),
                "detail": "kubelet %s, plan %s" % (reserved, planned),
            }
        )
    try:
        units = drift["checks"]["unit_threads"].get("units") or {}
    except (TypeError, KeyError, AttributeError):
        units = {}
    for group, text in zip(groups, units_shown):
        name = group["name"]
        shown = _systemctl_show(text)
        node = group.get("memory_node", group.get("numa_node"))
        active = shown.get("ActiveState", "")
        out.append(
            {
                "check": "shminfer@%s CPUAffinity/NUMA = plan" % name,
                "ok": active == "active"
                and _cpus(shown.get("CPUAffinity")) == list(group["cpus"])
                and shown.get("NUMAPolicy") == "bind"
                and _cpus(shown.get("NUMAMask")) == [node],
                "detail": "%s, CPUAffinity %s (plan %s), NUMA %s:%s (plan bind:%s)"
                % (
                    active,
                    shown.get("CPUAffinity", ""),
                    group["cpulist"],
                    shown.get("NUMAPolicy", ""),
                    shown.get("NUMAMask", ""),
                    node,
                ),
            }
        )
        contained = units.get("shminfer@%s.service" % name) or {"threads": 0, "outside": []}
        outside = contained.get("outside") or []
        detail = "%s threads of %s processes" % (
            contained.get("threads", 0),
            contained.get("processes", 0),
        )
        if outside:
            detail += ", outside: %s (allowed %s, last ran on %s)" % (
                ", ".join(str(t.get("comm")) for t in outside[:5]),
                " | ".join(sorted({str(t.get("cpus_allowed")) for t in outside})),
                ",".join(sorted({str(t.get("last_cpu")) for t in outside})),
            )
        else:
            detail += ", all allowed and last run on the group"
        out.append(
            {
                "check": "shminfer@%s threads inside %s" % (name, group["cpulist"]),
                "ok": contained.get("threads", 0) > 0 and not outside,
                "detail": detail,
            }
        )
    return out


__all__ = [
    "DEFAULT_HWLATDETECT_MAX_US",
    "DEFAULT_THRESHOLDS",
    "KINDS",
    "SCHEMA_VERSION",
    "SETTINGS",
    "VERDICTS",
    "PostcheckError",
    "check_settings",
    "consistency_checks",
    "cyclictest_thresholds",
    "format_percentile",
    "gate_cyclictest",
    "gate_host",
    "gate_hwlatdetect",
    "gate_oslat",
    "hardware_gate",
    "load_result",
    "parse_cyclictest",
    "parse_hwlatdetect",
    "parse_oslat",
    "validate_result",
]
