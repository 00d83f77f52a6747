"""Batched file reads for the testinfra suite (imported by conftest.py and the tests)."""

from __future__ import annotations

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
