"""The post-check's record: the per-host result file, its reader, and the role's settings.

The post-check is four modules, stdlib-only and Python >= 3.9 like :mod:`rtfleet.topology`:
this one (the result's schema, :func:`validate_result`, :func:`load_result`,
:func:`check_settings` and :class:`PostcheckError`), ``postcheck_parse.py`` (the parsers of
cyclictest, oslat and hwlatdetect output), ``postcheck_gate.py`` (the gates and a host's
verdict, :func:`gate_host`) and ``postcheck_consistency.py`` (kernel, kubelet and units
against the plan). The Ansible filters (``rtfleet_cyclictest``, ``rtfleet_postcheck_gate``)
call them on the controller and ``rtfleet report`` calls them for the whole fleet, so a
host's verdict comes from one computation.

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
"""

from __future__ import annotations

import json

SCHEMA_VERSION = 1
KINDS = ("tuned", "baseline")


class PostcheckError(Exception):
    """Malformed post-check input; the message says what to fix."""


# --------------------------------------------------------------------------- result file


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


__all__ = [
    "KINDS",
    "SCHEMA_VERSION",
    "SETTINGS",
    "PostcheckError",
    "check_settings",
    "load_result",
    "validate_result",
]
