"""The BIOS / firmware checklist, verified from what the OS can see.

Takes the dict that :func:`rtfleet.topology.read_topology` returns (never touches a host),
so it runs the same in the CLI and on targets: stdlib-only, Python >= 3.9, and shipped as
Ansible module_utils (``plugins/module_utils/rtfleet_checklist.py`` is a symlink to it).

Every item has a status: ``ok``, ``mismatch`` (fails the host unless waived), ``waived``,
``not_checked`` (no wanted value) or ``manual`` (the OS cannot see it: verify in setup).
"""

from __future__ import annotations

# What a latency-tuned host wants unless the inventory says otherwise. None = not checked.
DEFAULT_WANTED = {
    "nps": None,  # NUMA nodes per socket (AMD NPS1/2/4; L3-as-NUMA shows up here too)
    "smt": None,  # "on" | "off"
    "boost": None,  # "on" | "off"
    "max_idle_latency_us": 10,  # no enabled C-state may take longer to exit than this
    "frequency_driver": None,  # list of accepted scaling drivers
    "governor": "performance",
    "memory_balance_max_ratio": 1.1,  # largest / smallest node memory
    # DIMM population: every NUMA node with CPUs has memory (no memoryless socket/node).
    "memory_on_every_node": True,
}

# Settings the OS cannot read back; listed so a person checks them in firmware setup.
MANUAL_ITEMS = (
    ("power_profile", "Vendor power profile set to maximum performance / OS control"),
    ("determinism", "AMD: Determinism Slider per the vendor's low-latency guide"),
    ("df_cstates", "AMD: Data Fabric C-states disabled, APBDIS=1 (fixed SoC P-state)"),
    ("xgmi", "AMD 2P: xGMI link width and speed fixed at maximum"),
    ("memory_population", "All memory channels populated, same DIMMs on every channel"),
)


class ChecklistError(ValueError):
    """Bad wanted values or waivers; the message says what to fix."""


def _validate(wanted, waivers):
    unknown = sorted(set(wanted) - set(DEFAULT_WANTED))
    if unknown:
        raise ChecklistError(
            "unknown checklist items %s; known: %s" % (unknown, ", ".join(sorted(DEFAULT_WANTED)))
        )
    merged = dict(DEFAULT_WANTED)
    merged.update(wanted or {})
    if merged["memory_on_every_node"] not in (None, True, False):
        raise ChecklistError(
            "memory_on_every_node must be true, false or null, got %r"
            % (merged["memory_on_every_node"],)
        )
    for key in ("smt", "boost"):
        if merged[key] not in (None, "on", "off"):
            raise ChecklistError('%s must be "on", "off" or null, got %r' % (key, merged[key]))
    if merged["nps"] is not None and merged["nps"] not in (1, 2, 3, 4, 6, 8, 12, 16):
        raise ChecklistError(
            "nps must be the NUMA nodes per socket (1, 2, 4, ...), got %r" % (merged["nps"],)
        )
    drivers = merged["frequency_driver"]
    if drivers is not None and (
        isinstance(drivers, str) or not all(isinstance(d, str) for d in drivers)
    ):
        raise ChecklistError(
            "frequency_driver must be a list of driver names, e.g. [amd-pstate-epp, acpi-cpufreq]"
        )
    known = set(DEFAULT_WANTED) | {item[0] for item in MANUAL_ITEMS}
    bad = sorted(set(waivers or ()) - known)
    if bad:
        raise ChecklistError(
            "waivers name unknown items %s; known: %s" % (bad, ", ".join(sorted(known)))
        )
    return merged


def _item(name, wanted, observed, ok, hint):
    if wanted is None:
        status = "not_checked"
    elif observed is None:
        status = "manual"
    else:
        status = "ok" if ok else "mismatch"
    return {"item": name, "wanted": wanted, "observed": observed, "status": status, "hint": hint}


def evaluate(topology, wanted=None, waivers=()):
    """Check the topology's firmware-visible state against ``wanted``."""
    wanted = _validate(wanted or {}, waivers)
    items = _observed_items(topology, wanted)
    for name, hint in MANUAL_ITEMS:
        items.append(
            {"item": name, "wanted": "see hint", "observed": None, "status": "manual", "hint": hint}
        )
    waived = set(waivers or ())
    for item in items:
        if item["item"] in waived and item["status"] in ("mismatch", "manual"):
            item["status"] = "waived"
    failed = [i["item"] for i in items if i["status"] == "mismatch"]
    return {
        "ok": not failed,
        "failed": failed,
        "manual": [i["item"] for i in items if i["status"] == "manual"],
        "items": items,
    }


def _observed(topology):
    """What the OS shows of each checked item (None where it shows nothing)."""
    power = topology.get("power") or {}
    nodes = [n for n in topology["numa_nodes"] if n["cpus"]]
    packages = max(1, len(topology["packages"]))
    nps = len(nodes) // packages if len(nodes) % packages == 0 else round(len(nodes) / packages, 2)
    enabled = [s for s in power.get("idle_states", []) if not s["disabled"]]
    deepest = max(enabled, key=lambda s: s["latency_us"]) if enabled else None
    memory = [n["memory_kb"] for n in nodes if n.get("memory_kb")]
    balance = (
        round(max(memory) / min(memory), 3)
        if len(memory) > 1 and min(memory)
        else (1.0 if memory else None)
    )
    return {
        "power": power,
        "nps": nps,
        "smt": "on" if topology["smt"]["threads_per_core"] > 1 else "off",
        "boost": None if power.get("boost") is None else ("on" if power["boost"] else "off"),
        "deepest": deepest,
        "balance": balance,
        "memoryless": [
            n["id"] for n in nodes if n.get("has_memory") is False or n.get("memory_kb") == 0
        ],
    }


def _memoryless_hint(memoryless):
    if not memoryless:
        return "BIOS/DIMMs: every socket (NUMA node) needs populated memory channels"
    return (
        "DIMM population: NUMA node%s %s %s CPUs but no memory (no DIMMs on that socket or "
        "die): every memory access from %s crosses to another node; populate its channels"
        % (
            "s" if len(memoryless) > 1 else "",
            ", ".join(str(n) for n in memoryless),
            "have" if len(memoryless) > 1 else "has",
            "them" if len(memoryless) > 1 else "it",
        )
    )


def _observed_items(topology, wanted):
    """One item per checked setting: wanted, observed, status and where to change it."""
    seen = _observed(topology)
    power, nps, smt, boost = seen["power"], seen["nps"], seen["smt"], seen["boost"]
    deepest, balance, memoryless = seen["deepest"], seen["balance"], seen["memoryless"]
    limit = wanted["max_idle_latency_us"]
    return [
        _item(
            "nps",
            wanted["nps"],
            nps,
            nps == wanted["nps"],
            "BIOS: NUMA nodes per socket (NPS); L3-as-NUMA also raises it",
        ),
        _item(
            "smt",
            wanted["smt"],
            smt,
            smt == wanted["smt"],
            "BIOS: SMT / Hyper-Threading (or `nosmt` on the kernel command line)",
        ),
        _item(
            "boost",
            wanted["boost"],
            boost,
            boost == wanted["boost"],
            "BIOS: Core Performance Boost / Turbo; or the cpufreq boost knob",
        ),
        _item(
            "max_idle_latency_us",
            limit,
            None if not power.get("idle_states") else (deepest["latency_us"] if deepest else 0),
            deepest is None or limit is None or deepest["latency_us"] <= (limit or 0),
            "BIOS: Global C-state control; kernel: processor.max_cstate / intel_idle.max_cstate"
            + ("; deepest enabled: %s" % deepest["name"] if deepest else ""),
        ),
        _item(
            "frequency_driver",
            wanted["frequency_driver"],
            power.get("frequency_driver"),
            power.get("frequency_driver") in (wanted["frequency_driver"] or ()),
            "BIOS: CPPC / OS control of P-states; kernel: amd_pstate= or intel_pstate=",
        ),
        _item(
            "governor",
            wanted["governor"],
            power.get("governor"),
            power.get("governor") == wanted["governor"],
            "cpufreq governor (the host role sets it; tuned profiles too)",
        ),
        _item(
            "memory_balance_max_ratio",
            wanted["memory_balance_max_ratio"],
            balance,
            balance is not None and balance <= (wanted["memory_balance_max_ratio"] or 0),
            "largest/smallest NUMA node memory: populate every channel alike",
        ),
        _item(
            "memory_on_every_node",
            wanted["memory_on_every_node"],
            memoryless,
            not memoryless or not wanted["memory_on_every_node"],
            _memoryless_hint(memoryless),
        ),
    ]
