"""Tables for people: topology and plan, drawn with rich."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from rtfleet.cpulist import format_cpulist


def _console() -> Console:
    # Piped output (CI logs, reports) gets room for the hint columns.
    return Console(highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 150)


def render_topology_table(topo: dict) -> None:
    console = _console()
    virt = topo["virtualization"]
    kernel = topo["kernel"]
    smt = topo["smt"]
    head = Table(show_header=False, box=None, pad_edge=False)
    head.add_column(style="bold")
    head.add_column()
    head.add_row("CPU", f"{topo['vendor'] or '?'} {topo['model_name'] or ''} ({topo['arch']})")
    head.add_row(
        "online CPUs",
        f"{format_cpulist(topo['cpus'])} ({len(topo['cpus'])})"
        + (f", offline {format_cpulist(topo['offline_cpus'])}" if topo["offline_cpus"] else ""),
    )
    head.add_row(
        "layout",
        f"{len(topo['packages'])} package(s), {len(topo['numa_nodes'])} NUMA node(s) "
        f"({topo['numa_source']}), {len(topo['l3_groups'])} L3 group(s) ({topo['l3_source']}), "
        f"{len(topo['cores'])} cores",
    )
    head.add_row(
        "SMT", f"{smt['threads_per_core']} thread(s)/core, control={smt['control'] or 'n/a'}"
    )
    head.add_row(
        "kernel", f"{kernel['release']} ({kernel['preempt']}, flavour {kernel['flavour']})"
    )
    iso = topo["isolation"]
    head.add_row(
        "isolation",
        f"isolated={format_cpulist(iso['isolated']) or '-'} "
        f"nohz_full={format_cpulist(iso['nohz_full']) or '-'}",
    )
    machine = (
        "virtual (" + (virt["hypervisor"] or "?") + ")" if virt["is_virtual"] else "bare metal"
    )
    head.add_row("machine", machine)
    console.print(head)

    table = Table(title="L3 groups (pin units here)", title_justify="left")
    for column in ("L3", "CPUs", "count", "NUMA node", "package", "size"):
        table.add_column(column)
    for group in topo["l3_groups"]:
        node = group["numa_node"]
        table.add_row(
            str(group["id"]),
            format_cpulist(group["cpus"]),
            str(len(group["cpus"])),
            str(node) if node is not None else "spans " + format_cpulist(group["numa_nodes"]),
            str(group["package"]) if group["package"] is not None else "spans",
            group["size"] or "-",
        )
    console.print(table)

    nodes = Table(title="NUMA nodes", title_justify="left")
    for column in ("node", "CPUs", "L3 groups", "memory"):
        nodes.add_column(column)
    for node in topo["numa_nodes"]:
        memory = f"{node['memory_kb'] / 1048576:.1f} GiB" if node["memory_kb"] else "-"
        nodes.add_row(
            str(node["id"]),
            format_cpulist(node["cpus"]) or "-",
            format_cpulist(node["l3_groups"]) or "-",
            memory,
        )
    console.print(nodes)

    deception = virt["deception"]
    if deception["deceptive"]:
        console.print("[bold red]TOPOLOGY DECEPTION:[/] " + deception["summary"])
        for line in deception["evidence"]:
            console.print("  - " + line)


def render_plan_table(topo: dict, plan: dict) -> None:
    console = _console()
    sets = Table(title="CPU partition", title_justify="left")
    for column in ("set", "CPUs", "count"):
        sets.add_column(column)
    for name in ("housekeeping", "runtime", "pod_pool"):
        sets.add_row(name, plan["cpulists"][name] or "-", str(len(plan[name])))
    console.print(sets)

    groups = Table(title="Runtime groups (one shminfer unit each)", title_justify="left")
    for column in ("unit", "CPUAffinity", "workers", "NUMAMask", "L3", "note"):
        groups.add_column(column)
    for group in plan["runtime_groups"]:
        groups.add_row(
            group["name"],
            group["systemd"]["CPUAffinity"],
            format_cpulist(group["worker_cpus"]),
            group["systemd"]["NUMAMask"],
            str(group["l3_group"]),
            "shares L3 with housekeeping" if group["partial_l3"] else "",
        )
    console.print(groups)

    derived = Table(title="Derived settings", title_justify="left", show_header=False)
    derived.add_column(style="bold")
    derived.add_column()
    derived.add_row("kernel args", " ".join(plan["kernel_args"]) or "-")
    derived.add_row("kubelet reservedSystemCPUs", plan["kubelet"]["reservedSystemCPUs"])
    derived.add_row("irqbalance banned CPUs", plan["irqbalance_banned_cpus"] or "-")
    derived.add_row("systemd CPUAffinity", plan["systemd_cpu_affinity"])
    console.print(derived)
    for warning in plan["warnings"]:
        console.print("[yellow]warning:[/] " + warning)


_STATUS_STYLE = {
    "ok": "green",
    "mismatch": "bold red",
    "waived": "yellow",
    "manual": "cyan",
    "not_checked": "dim",
}


def render_checklist_table(result: dict) -> None:
    console = _console()
    table = Table(title="BIOS / firmware checklist (from the OS)", title_justify="left")
    for column in ("item", "wanted", "observed", "status", "how to fix"):
        table.add_column(column)
    for item in result["items"]:
        style = _STATUS_STYLE.get(item["status"], "")
        table.add_row(
            item["item"],
            str(item["wanted"]),
            "-" if item["observed"] is None else str(item["observed"]),
            f"[{style}]{item['status']}[/]",
            item["hint"],
        )
    console.print(table)
    console.print("PASSED" if result["ok"] else "FAILED: " + ", ".join(result["failed"]))
