"""plugins/module_utils/original.py on server-sized trees: the host as it was is recorded,
the real rtfleet-host-tune changes it as the host role does, the check finds every change,
and restoring the live settings brings the check back to nothing. Records that are not this
host's, edited, or of another schema are refused in one line."""

import json

import pytest
from sysfs_gen import build_tree
from test_host_tune import _fake_proc, _run_tuner

from ansible_collections.rtfleet.fleet.plugins.module_utils.original import (
    RecordError,
    compare,
    leftovers,
    packages_to_remove,
    parse_record,
    read_host,
    restore_live,
    seal,
)
from rtfleet.planner import plan_partition
from rtfleet.topology import read_topology

SYSCTLS = {"kernel.numa_balancing": 0, "kernel.sched_rt_runtime_us": -1}
BOOT = {
    "release": "6.1.0-28-amd64",
    "cmdline": "BOOT_IMAGE=/vmlinuz ro quiet",
    "grub_default": None,
}
UNITS = {"irqbalance.service": {"enabled": "disabled", "active": "inactive"}}
DPKG = """Package: base-files
Status: install ok installed
Architecture: amd64

Package: linux-image-6.1.0-28-amd64
Status: install ok installed

Package: rt-tests
Status: deinstall ok config-files
"""


def _host(tmp_path, shape):
    root = build_tree(shape, tmp_path / "host")
    topology = read_topology(str(root))
    nbits = max(topology["present_cpus"]) + 1
    _fake_proc(root, nbits, irqs=[0, 1, 24, 120])
    (root / "proc/sys/kernel/sched_rt_runtime_us").write_text("950000\n")
    (root / "etc").mkdir(exist_ok=True)
    (root / "etc/machine-id").write_text("0123456789abcdef0123456789abcdef\n")
    (root / "var/lib/dpkg").mkdir(parents=True)
    (root / "var/lib/dpkg/status").write_text(DPKG)
    return root, topology


def _live(root):
    return read_host(str(root), SYSCTLS, BOOT, UNITS)


@pytest.mark.parametrize(
    "shape",
    # 336 CPUs with SMT on 2 sockets; a memoryless node 0; CXL memory nodes without CPUs
    ["epyc-9634-2s", "xeon-2s-memoryless-node0", "epyc-9354-2s-nps4-cxl"],
)
def test_tuning_is_found_and_undone(tmp_path, shape):
    root, topology = _host(tmp_path, shape)
    record = seal(_live(root), "2026-12-03T00:00:00Z")
    body = parse_record(json.dumps(record), record["machine_id"], "host.json")
    assert compare(body, _live(root)) == []

    plan = plan_partition(topology, {"housekeeping_cores_per_node": 1})
    nodes = [node["id"] for node in topology["numa_nodes"] if node["has_memory"]]
    gov_file = root / "sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"
    governor = None
    if gov_file.exists():
        governor = "powersave" if gov_file.read_text().strip() == "performance" else "performance"
    config = {
        "housekeeping_cpus": plan["cpulists"]["housekeeping"],
        "irq_default_affinity_mask": plan["irq_default_affinity_mask"],
        "irq_mode": "static",
        "governor": governor,
        "sysctls": SYSCTLS,
        "hugepages": {"size_kb": 2048, "per_node": {str(n): 8 for n in nodes}},
    }
    tuned = _run_tuner(root, config)
    assert tuned.returncode in (0, 1), tuned.stderr
    (root / "etc/sysctl.d").mkdir(parents=True)
    (root / "etc/sysctl.d/90-rtfleet.conf").write_text("kernel.numa_balancing = 0\n")

    diffs = compare(body, _live(root))
    text = "\n".join(diffs)
    assert "sysctls kernel.numa_balancing: '0', originally '1'" in text
    assert "sysctls kernel.sched_rt_runtime_us: '-1', originally '950000'" in text
    assert "IRQ default affinity" in text
    assert "IRQ 120 affinity: %s" % plan["cpulists"]["housekeeping"] in text
    if governor:
        assert "governors cpu0: '%s'" % governor in text
    assert ("hugepages node%d" % nodes[0]) in text
    assert "rtfleet left on the host: /etc/sysctl.d/90-rtfleet.conf" in text

    changed, skipped = restore_live(str(root), body, check=True)
    assert changed and skipped == []
    assert len(compare(body, _live(root))) == len(diffs), "check mode wrote something"
    restore_live(str(root), body)
    (root / "etc/sysctl.d/90-rtfleet.conf").unlink()
    assert compare(body, _live(root)) == []
    assert restore_live(str(root), body) == ([], [])


def test_a_record_that_is_not_this_hosts_is_refused(tmp_path):
    root, _ = _host(tmp_path, "xeon-2s-smt")
    record = seal(_live(root), "2026-12-03T00:00:00Z")
    text = json.dumps(record)
    with pytest.raises(
        RecordError, match=r"recorded on machine-id 0123.*this host is ffff.*cloned disk"
    ):
        parse_record(text, "ffff", "/var/lib/rtfleet/original/host.json")
    edited = dict(record, sysctls=dict(record["sysctls"], **{"kernel.numa_balancing": "0"}))
    with pytest.raises(RecordError, match="edited or damaged"):
        parse_record(json.dumps(edited), record["machine_id"], "host.json")
    newer = dict(record, schema=99)
    with pytest.raises(RecordError, match="schema 99"):
        parse_record(json.dumps(newer), record["machine_id"], "host.json")
    for bad in ("", "[]", "{", '{"schema": 1}'):
        with pytest.raises(RecordError) as err:
            parse_record(bad, record["machine_id"], "host.json")
        assert "\n" not in str(err.value) and "nothing was changed" in str(err.value)


def test_leftovers_name_every_rtfleet_path(tmp_path):
    root = tmp_path
    for rel in (
        "etc/rtfleet/plan.json",
        "etc/systemd/system/rtfleet-drift.timer",
        "etc/systemd/system/system.slice.d/50-rtfleet.conf",
        "etc/systemd/system/timers.target.wants/rtfleet-drift.timer",
        "etc/default/grub.d/rtfleet.cfg.1234.2026-12-03@10:00:00~",
        "etc/systemd/system/shminfer@ccx0.service.d/50-rtfleet.conf",
        "etc/systemd/system/sshd.service.d/override.conf",
    ):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x")
    found = leftovers(str(root))
    assert "etc/systemd/system/sshd.service.d/override.conf" not in found
    assert {
        "etc/rtfleet",
        "etc/systemd/system/rtfleet-drift.timer",
        "etc/systemd/system/system.slice.d/50-rtfleet.conf",
        "etc/systemd/system/timers.target.wants/rtfleet-drift.timer",
        "etc/default/grub.d/rtfleet.cfg.1234.2026-12-03@10:00:00~",
        "etc/systemd/system/shminfer@ccx0.service.d",
    } <= set(found)
    assert leftovers(str(root), existed_before=found) == []


def test_kernel_packages_that_came_with_rtfleet_are_removed_with_it():
    original = ["base-files", "linux-image-6.1.0-28-amd64"]
    now = [*original, "linux-image-rt-amd64", "linux-image-6.1.0-28-rt-amd64", "podman", "vim"]
    assert packages_to_remove(original, now, ["linux-image-rt-amd64", "rt-tests"]) == [
        "linux-image-6.1.0-28-rt-amd64",
        "linux-image-rt-amd64",
    ]
    assert packages_to_remove(original, original, ["linux-image-rt-amd64"]) == []
    assert packages_to_remove(now, now, ["linux-image-rt-amd64"]) == []


def test_irqs_are_known_by_their_handlers_across_boots(tmp_path):
    """Seen on the lab host: after restore's reboot one more IRQ was set up early, so every
    virtio queue IRQ had the number after its old one. By number, ten IRQs "differed"."""

    def boot(root, first):
        for n, (name, cpus) in enumerate(
            [("virtio1-config", "0-7"), ("virtio1-req.0", "0-3"), ("virtio1-req.1", "4")],
            start=first,
        ):
            (root / f"proc/irq/{n}/{name}").mkdir(parents=True)
            (root / f"proc/irq/{n}/smp_affinity_list").write_text(cpus + "\n")
        (root / "proc/irq/0").mkdir(parents=True, exist_ok=True)
        (root / "proc/irq/0/smp_affinity_list").write_text("0-7\n")
        (root / "proc/irq/default_smp_affinity").write_text("ff\n")

    before, after = tmp_path / "before", tmp_path / "after"
    boot(before, 24)
    boot(after, 25)
    record = read_host(str(before), {}, BOOT, UNITS)
    assert record["irqs"]["affinity"] == {
        "0": "0-7",
        "virtio1-config": "0-7",
        "virtio1-req.0": "0-3",
        "virtio1-req.1": "4",
    }
    assert compare(record, read_host(str(after), {}, BOOT, UNITS)) == []
    (after / "proc/irq/27/smp_affinity_list").write_text("0\n")
    live = read_host(str(after), {}, BOOT, UNITS)
    assert compare(record, live) == ["IRQ virtio1-req.1 affinity: 0, originally 4"]
    assert restore_live(str(after), record)[0] == ["IRQ virtio1-req.1 -> 4"]
    assert (after / "proc/irq/27/smp_affinity_list").read_text() == "4"
