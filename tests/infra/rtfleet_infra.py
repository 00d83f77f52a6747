"""What the testinfra suite's tests share (imported by conftest.py and the tests): batched
file reads, and one run of the drift guard on the host -- the one checker of a host against
its plan, whose checks the post-check's consistency step words for the report."""

from __future__ import annotations

import json

from prometheus_client.parser import text_string_to_metric_families

GUARD = "/usr/local/sbin/rtfleet-drift"
# Every ssh round trip costs seconds on a TCG guest: one guard run is one shell script.
# The guard as its timer runs it (the role's textfile dir and drop-in), its JSON, then \036
# and the textfile.
_ARGV = (
    "argv=$(systemctl show -P ExecStart rtfleet-drift.service"
    " | sed -n 's/.*argv\\[\\]=\\([^;]*\\);.*/\\1/p')"
)
_GUARD = (
    _ARGV + "; err=$(mktemp); $argv --json %(args)s 2>$err; rc=$?; printf '\\037%%s\\n' $rc; "
    "cat $err; rm -f $err; printf '\\036'; "
    'dir=$(echo $argv | sed -n "s/.*--textfile-dir \\([^ ]*\\).*/\\1/p"); '
    'cat "$dir/rtfleet_drift.prom" 2>/dev/null'
)

_CACHE: dict = {}
# \036 starts a file, \037 ends its name, \025 marks one that could not be read.
_SCRIPT = (
    "for f in %s; do printf '\\036%%s\\037' \"$f\"; cat \"$f\" 2>/dev/null || printf '\\025'; done"
)


def read_files(host, *paths):
    """{path: content or None} for many files in one round trip (cached per host).

    Under a slow link (or a TCG lab VM) every ssh command costs seconds, so the suite reads
    what it needs in batches instead of one command per file.
    """
    key = (host.backend.get_pytest_id(), paths)
    if key not in _CACHE:
        # Paths may be globs (/proc/irq/*/smp_affinity_list).
        out = host.run(_SCRIPT % " ".join(paths)).stdout
        files = {}
        for chunk in out.split("\036")[1:]:
            path, _, content = chunk.partition("\037")
            files[path] = None if content.endswith("\025") else content
        _CACHE[key] = files
    return _CACHE[key]


def drift_guard(host, args="", before=""):
    """(exit code, result, stderr, textfile metrics) of one run of rtfleet-drift on the host as
    its timer runs it, after the shell commands ``before``."""
    run = host.run(before + _GUARD % {"args": args})
    out, _, textfile = run.stdout.partition("\036")
    result, _, tail = out.partition("\037")
    code, _, log = tail.partition("\n")
    assert code.strip() in ("0", "1"), "rtfleet-drift exit %s: %s %s" % (code, log, run.stderr)
    metrics = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(textfile)
        for sample in family.samples
    }
    return int(code), json.loads(result), log, metrics
