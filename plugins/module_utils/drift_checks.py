"""The drift guard's checks, by name, in the order it runs and reports them.

Shared by rtfleet-drift on a node (roles/rtfleet_host/files/rtfleet_node/drift.py, which
documents each check) and the fleet report's drift section (report_drift.py).
"""

CHECKS = (
    "cmdline",
    "isolation",
    "irqs",
    "irqbalance",
    "tuned",
    "sysctls",
    "hugepages",
    "governor",
    "units",
    "unit_threads",
    "kubelet",
)
