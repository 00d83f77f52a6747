"""The post-check's gates: failure messages per tool, and one host's verdict.

:func:`gate_hwlatdetect`, :func:`gate_cyclictest`, :func:`gate_oslat` and :func:`gate_smoke`
judge one tool's figures (parsed by ``postcheck_parse.py``) against the thresholds the role
recorded; :func:`hardware_gate` and :func:`gate_host` run them in OpenShift's order on a
per-host result (``postcheck.py``) and give its verdict. Each failure message names the
value, the limit and the CPUs.
"""

from __future__ import annotations

from .postcheck import PostcheckError, validate_result
from .postcheck_parse import format_percentile, parse_cyclictest, parse_hwlatdetect, parse_oslat
from .cpulist import TopologyError, format_cpulist, parse_cpulist

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

# How many CPUs a failure message names before it says "and N more".
_NAMED_CPUS = 8


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


# --------------------------------------------------------------------------- cyclictest


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


def _beyond(template, worst, picked, rows, limit, *, value_text):
    """``template`` filled in for the rows past a limit (``picked``, worst first): the worst
    value, its CPU, the limit, how many of how many CPUs, and the first CPUs named."""
    return template % (
        worst,
        _cpu_label(picked[0]),
        _num(limit),
        len(picked),
        len(rows),
        _named(picked, value_text),
    )


def _max_over(tool, rows, limit):
    """The failure, if any, of rows whose worst case (``max_us``) is over ``limit``."""
    if limit is None:
        return []
    over = sorted((r for r in rows if r["max_us"] > limit), key=lambda r: -r["max_us"])
    if not over:
        return []
    return [
        _beyond(
            tool + " max latency %d µs on %s exceeds the %s µs limit (%d of %d CPUs over: %s)",
            over[0]["max_us"],
            over,
            rows,
            limit,
            value_text=lambda r: "%d µs" % r["max_us"],
        )
    ]


def _short_runs(rows, min_cycles):
    """The failure, if any, of rows that ran fewer than ``min_cycles`` cycles."""
    if min_cycles is None:
        return []
    short = sorted((r for r in rows if r["cycles"] < min_cycles), key=lambda r: r["cycles"])
    if not short:
        return []
    return [
        _beyond(
            "cyclictest ran only %d cycles on %s, fewer than the %s minimum (%d of %d CPUs "
            "short: %s): run it longer (--duration) so the worst case means something",
            short[0]["cycles"],
            short,
            rows,
            min_cycles,
            value_text=lambda r: "%d" % r["cycles"],
        )
    ]


def _p999_over(rows, hist_us, limit):
    """The failures of rows whose p99.9 is over ``limit``, or cannot be told from the run."""
    if limit is None:
        return []
    if hist_us is None:
        return [
            "cyclictest ran without --histogram, so p99.9 cannot be checked against the "
            "%s µs limit: add --histogram=<µs above the limit>" % _num(limit)
        ]
    # Beyond the histogram means >= hist_us: over the limit for sure only when
    # hist_us > limit; otherwise the run cannot tell, which fails too.
    over = [
        r
        for r in rows
        if (r["p999_beyond_histogram"] and hist_us > limit)
        or (r["p999_us"] is not None and r["p999_us"] > limit)
    ]
    unknown = [r for r in rows if r["p999_beyond_histogram"] and hist_us <= limit]
    over.sort(key=lambda r: -(r["p999_us"] if r["p999_us"] is not None else hist_us))
    failures = []
    if over:
        failures.append(
            _beyond(
                "cyclictest p99.9 latency %s µs on %s exceeds the %s µs limit (%d of %d CPUs "
                "over: %s)",
                format_percentile(over[0], "p999", hist_us),
                over,
                rows,
                limit,
                value_text=lambda r: format_percentile(r, "p999", hist_us) + " µs",
            )
        )
    if unknown:
        failures.append(
            "cyclictest p99.9 on %s lies beyond the %d µs histogram, so the %s µs "
            "limit cannot be checked: rerun with --histogram above the limit"
            % (
                _named(unknown, lambda r: "(%d overflows)" % r["overflows"]),
                hist_us,
                _num(limit),
            )
        )
    return failures


def gate_cyclictest(parsed, thresholds=None):
    """Failure messages (empty when the run passes) for a :func:`parse_cyclictest` result.

    ``parsed`` may also be the raw cyclictest document. ``thresholds``: ``max_us``
    (default 100), ``p999_us`` (default off), ``min_cycles`` (default 10000); a None value
    switches that check off. Each message names the value, the limit and the CPUs.
    """
    parsed = _as_parsed(parsed)
    limits = _limits(thresholds)
    rows = parsed["cpus"]
    return (
        _short_runs(rows, limits["min_cycles"])
        + _max_over("cyclictest", rows, limits["max_us"])
        + _p999_over(rows, parsed["summary"]["histogram_us"], limits["p999_us"])
    )


def _num(value):
    return "%g" % value


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


# --------------------------------------------------------------------------- oslat


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


# --------------------------------------------------------------------------- smoke and host


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


__all__ = [
    "DEFAULT_HWLATDETECT_MAX_US",
    "DEFAULT_SMOKE_MAX_JITTER",
    "DEFAULT_THRESHOLDS",
    "VERDICTS",
    "cyclictest_thresholds",
    "gate_cyclictest",
    "gate_host",
    "gate_hwlatdetect",
    "gate_oslat",
    "gate_smoke",
    "hardware_gate",
    "smoke_client_placement",
]
