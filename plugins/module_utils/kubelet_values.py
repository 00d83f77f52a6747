"""How kubelet spells its values, and how it merges a drop-in over its config file.

Kubelet's parsers, mirrored: resource quantities ("1Gi", "512M", "1e9"), Go durations
("1m30s"), cpusets ("0-3,8"), Go booleans in option maps, kubelet versions ("v1.31.4"), and
the drop-in merge (maps merge key by key, the rest replaces). Also the error every kubelet
module raises for settings that cannot become a configuration. Stdlib-only, Python 3.9.
"""

from __future__ import annotations

import copy
import re
from fractions import Fraction

from .cpulist import TopologyError, format_cpulist, parse_cpulist

# strconv.ParseBool: what kubelet accepts where an option map holds a boolean.
GO_BOOLS = {"1", "t", "T", "TRUE", "true", "True", "0", "f", "F", "FALSE", "false", "False"}
_BINARY_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL_SUFFIX = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)(?:([eE][+-]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)$")
_DURATION = re.compile(r"^(?:([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h))+$")
_DURATION_PART = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")
_DURATION_NS = {"ns": 1, "us": 10**3, "µs": 10**3, "ms": 10**6, "s": 10**9, "m": 60 * 10**9}
_DURATION_NS["h"] = 3600 * 10**9
HUGEPAGES = re.compile(r"^hugepages-([0-9]+(?:Ki|Mi|Gi))$")


class KubeletConfigError(Exception):
    """Settings that cannot produce a kubelet configuration; the message says what to change."""


def parse_version(text):
    """ "1.31", "v1.31.4", "1.31.0-rc.1" -> (1, 31)."""
    match = re.match(r"^v?(\d+)\.(\d+)(?:\.\d+)?(?:[-+].*)?$", str(text).strip())
    if not match:
        raise KubeletConfigError(
            'kubelet_version must look like "1.31" or "v1.31.4", got %r' % (text,)
        )
    return int(match.group(1)), int(match.group(2))


def parse_cpuset(text):
    """Kubelet's cpuset syntax (k8s.io/utils/cpuset Parse): sorted ints; ValueError if not.

    The strict mode of rtfleet's one cpulist parser: "" is empty, otherwise "N" / "N-M" items
    joined by "," with no spaces, no empty item ("0-3," fails) and no stride.
    """
    try:
        return parse_cpulist(str(text), "reservedSystemCPUs", strict=True)
    except TopologyError as exc:
        raise ValueError(str(exc).split(": ", 1)[-1]) from None


# [0, 1, 2, 8] -> "0-2,8": the same spelling kubelet uses.
format_cpuset = format_cpulist


def parse_quantity(value):
    """A Kubernetes resource quantity ("1Gi", "512M", "1e9", 1024) -> Fraction."""
    if isinstance(value, bool):
        raise ValueError("%r is not a quantity" % (value,))
    if isinstance(value, int):
        return Fraction(value)
    match = _QUANTITY.match(str(value).strip())
    if not match:
        raise ValueError("%r is not a quantity" % (value,))
    try:
        number = Fraction(match.group(1))
    except (ValueError, ZeroDivisionError):
        raise ValueError("%r is not a quantity" % (value,)) from None
    if match.group(2):
        return number * Fraction(10) ** int(match.group(2)[1:])
    suffix = match.group(3) or ""
    return number * (_BINARY_SUFFIX.get(suffix) or _DECIMAL_SUFFIX[suffix])


def format_bytes(amount):
    """Exact bytes -> the largest binary unit that divides them ("1536Mi")."""
    amount = int(amount)
    for suffix in ("Gi", "Mi", "Ki"):
        unit = _BINARY_SUFFIX[suffix]
        if amount and amount % unit == 0:
            return "%d%s" % (amount // unit, suffix)
    return str(amount)


def parse_duration(text):
    """A Go duration ("10s", "1m30s", "500ms") -> nanoseconds; ValueError when malformed."""
    text = str(text).strip()
    if text == "0":
        return 0
    if not _DURATION.match(text):
        raise ValueError("%r is not a duration" % text)
    return int(sum(Fraction(n) * _DURATION_NS[unit] for n, unit in _DURATION_PART.findall(text)))


def merge(base, override):
    """Kubelet's drop-in merge: maps merge key by key, lists and scalars replace."""
    result = copy.deepcopy(base) if isinstance(base, dict) else {}
    for key, value in (override or {}).items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def truthy(options, name):
    """Whether option ``name`` is on in a map[string]string of options (ParseBool's true)."""
    return options.get(name) in ("1", "t", "T", "TRUE", "true", "True")
