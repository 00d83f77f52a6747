"""rtfleet.boot: the kernel command line the host role writes, and how a boot is verified.

The GRUB fixture is the lab image's real grub.cfg (Debian 12, update-grub); the Debian
default layout with a submenu is built from it the way 10_linux builds it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rtfleet.boot import (
    BootConfigError,
    compose_kernel_args,
    installed_kernels,
    isolation_expected,
    kernel_entry,
    parse_grub_cfg,
    parse_grubenv,
    pick_kernel,
    read_grub,
    read_running,
    resolve_entry,
    split_cmdline,
    verify,
)
from rtfleet.planner import plan_partition
from rtfleet.topology import read_topology

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GRUB_FLAT = (FIXTURES / "grub" / "lab-debian12-flat.cfg").read_text()
UUID = "ca77849c-feb6-48ca-8279-d36d92dffb07"
RT = "6.1.0-57-rt-amd64"
STOCK = "6.1.0-57-amd64"


def _with_submenu(cfg):
    """The same menu as Debian's default (GRUB_DISABLE_SUBMENU unset) lays it out."""
    head, _, rest = cfg.partition("menuentry ")
    body, _, tail = ("menuentry " + rest).partition("\n### END /etc/grub.d/10_linux ###")
    simple = (
        "menuentry 'Debian GNU/Linux' --class debian $menuentry_id_option 'gnulinux-simple-%s' {\n"
        "\tlinux\t/boot/vmlinuz-%s root=UUID=%s ro quiet\n}\n" % (UUID, RT, UUID)
    )
    nested = "".join("\t" + line + "\n" for line in body.strip("\n").splitlines())
    submenu = "submenu 'Advanced options for Debian GNU/Linux' $menuentry_id_option '%s' {\n%s}\n"
    submenu %= ("gnulinux-advanced-" + UUID, nested)
    return head + simple + submenu + "\n### END /etc/grub.d/10_linux ###" + tail


def test_grub_cfg_entries_from_the_lab_image():
    entries = parse_grub_cfg(GRUB_FLAT)
    assert [(e["release"], e["top_index"]) for e in entries] == [
        (RT, 0),
        (RT, 1),
        (STOCK, 2),
        (STOCK, 3),
    ]
    rt = kernel_entry(entries, RT)
    assert rt["id"] == "gnulinux-%s-advanced-%s" % (RT, UUID)
    assert rt["args"] == ["root=UUID=%s" % UUID, "ro", "console=ttyS0,115200"]
    assert kernel_entry(entries, STOCK)["title"] == "Debian GNU/Linux, with Linux %s" % STOCK
    assert kernel_entry(entries, "5.10.0-1-amd64") is None


def test_grub_saved_entry_resolves_by_title_id_index_and_path():
    entries = parse_grub_cfg(GRUB_FLAT)
    by_title = resolve_entry(entries, "Debian GNU/Linux, with Linux %s" % STOCK)
    assert by_title["release"] == STOCK
    assert resolve_entry(entries, by_title["id"]) is by_title
    assert resolve_entry(entries, "2") is by_title
    assert resolve_entry(entries, None)["release"] == RT  # no saved entry: the first one
    assert resolve_entry(entries, "no such entry") is None


def test_grub_submenu_layout_gives_paths_grub_accepts():
    entries = parse_grub_cfg(_with_submenu(GRUB_FLAT))
    simple, first = entries[0], entries[1]
    assert simple["top_index"] == 0 and first["top_index"] is None
    rt = kernel_entry(entries, RT)
    assert rt is first  # not the "simple" entry, not recovery
    assert rt["id_path"] == "gnulinux-advanced-%s>gnulinux-%s-advanced-%s" % (UUID, RT, UUID)
    assert rt["title_path"].startswith(
        "Advanced options for Debian GNU/Linux>Debian GNU/Linux, with Linux"
    )
    assert resolve_entry(entries, rt["id_path"]) is rt
    assert resolve_entry(entries, rt["id"]) is None  # a bare id inside a submenu is not enough


def test_grubenv_and_quoted_titles():
    env = parse_grubenv("# GRUB Environment Block\nsaved_entry=a>b\nnext_entry=\n" + "#" * 900)
    assert env == {"saved_entry": "a>b", "next_entry": ""}
    cfg = "menuentry 'It'\\''s here' --id odd {\n\tlinux /vmlinuz-1.0 ro\n}\n"
    assert parse_grub_cfg(cfg)[0]["title"] == "It's here"


def test_read_grub_and_running_from_a_root(tmp_path):
    (tmp_path / "boot/grub").mkdir(parents=True)
    (tmp_path / "boot/grub/grub.cfg").write_text(GRUB_FLAT)
    (tmp_path / "boot/grub/grubenv").write_text(
        "saved_entry=gnulinux-%s-advanced-%s\nnext_entry=rtfleet-trial\n" % (RT, UUID)
    )
    for name in ("vmlinuz-" + STOCK, "vmlinuz-" + RT, "vmlinuz-6.1.0-9-amd64", "config-" + RT):
        (tmp_path / "boot" / name).write_text("")
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/osrelease").write_text(RT + "\n")
    (tmp_path / "proc/cmdline").write_text(
        'BOOT_IMAGE=/boot/vmlinuz-%s ro isolcpus=managed_irq,1-3 nohz_full=1-3 x="a b"\n' % RT
    )
    (tmp_path / "sys/kernel").mkdir(parents=True)
    (tmp_path / "sys/kernel/realtime").write_text("1\n")
    (tmp_path / "sys/devices/system/cpu").mkdir(parents=True)
    (tmp_path / "sys/devices/system/cpu/isolated").write_text("\n")
    (tmp_path / "sys/devices/system/cpu/nohz_full").write_text("1,2,3\n")

    grub = read_grub(str(tmp_path))
    assert grub["default"]["release"] == RT and grub["next_entry"] == "rtfleet-trial"
    assert installed_kernels(str(tmp_path)) == [RT, STOCK, "6.1.0-9-amd64"]
    running = read_running(str(tmp_path))
    assert running["args"][-1] == 'x="a b"' and running["realtime"]
    assert running["nohz_full"] == "1-3" and running["isolated"] == ""
    wanted = {"release": RT, "flavour": "rt", "args": ["isolcpus=managed_irq,1-3", "nohz_full=1-3"]}
    assert verify(wanted, running) == []


def test_kernel_picking_by_flavour_and_version():
    assert pick_kernel(["6.1.0-57-rt-amd64", "6.1.0-57-amd64"], "rt") == "6.1.0-57-rt-amd64"
    assert pick_kernel(["6.1.0-57-rt-amd64", "6.1.0-57-amd64"], "tuned") == "6.1.0-57-amd64"
    assert pick_kernel(["5.14.0-362.8.1.el9_3.x86_64+rt"], "rt") == "5.14.0-362.8.1.el9_3.x86_64+rt"
    assert pick_kernel(["6.1.0-57-amd64"], "rt") is None


def test_installed_kernels_newest_first(tmp_path):
    (tmp_path / "boot").mkdir()
    for release in ("6.1.0-9-amd64", "6.1.0-57-amd64", "6.1.0-10-amd64"):
        (tmp_path / "boot" / ("vmlinuz-" + release)).write_text("")
    assert installed_kernels(str(tmp_path)) == ["6.1.0-57-amd64", "6.1.0-10-amd64", "6.1.0-9-amd64"]


@pytest.mark.parametrize(
    ("args", "isolated", "nohz"),
    [
        (["isolcpus=managed_irq,1-3,5-7", "nohz_full=1-3,5-7"], "", "1-3,5-7"),
        (["isolcpus=managed_irq,domain,2,3"], "2-3", ""),
        (["isolcpus=4-7"], "4-7", ""),
        (["isolcpus=nohz,managed_irq,1"], "", ""),
    ],
)
def test_isolation_expected_follows_the_kernels_isolcpus_flags(args, isolated, nohz):
    assert isolation_expected(args) == {"isolated": isolated, "nohz_full": nohz}


def test_verify_names_every_mismatch():
    running = {
        "release": STOCK,
        "cmdline": "ro",
        "args": ["ro", "nohz_full=1-3"],
        "realtime": False,
        "isolated": "",
        "nohz_full": "1-2",
    }
    problems = verify(
        {"release": RT, "flavour": "rt", "args": ["nohz_full=1-3", "skew_tick=1"]}, running
    )
    assert problems == [
        "running kernel is %s, wanted %s" % (STOCK, RT),
        "/sys/kernel/realtime is not 1: the running kernel is not PREEMPT_RT",
        "/proc/cmdline lacks skew_tick=1",
        "/sys/devices/system/cpu/nohz_full is '1-2', the plan says '1-3'",
    ]


def test_split_cmdline_keeps_quoted_values():
    assert split_cmdline(' a  b="c d" e=f\n') == ["a", 'b="c d"', "e=f"]


@pytest.fixture
def epyc(trees):
    topology = read_topology(str(trees("epyc-9634-2s")))
    return topology, plan_partition(topology, {"partial_l3_groups": "pod_pool"})


def test_compose_adds_host_wide_args_after_the_plans(epyc):
    topology, plan = epyc
    args = compose_kernel_args(
        plan, topology, {"max_cstate": 1, "amd_pstate": "passive", "panic_s": 10}
    )
    assert args[: len(plan["kernel_args"])] == plan["kernel_args"]
    assert args[len(plan["kernel_args"]) :] == [
        "skew_tick=1",
        "tsc=reliable",
        "nosoftlockup",
        "transparent_hugepage=never",
        "processor.max_cstate=1",
        "amd_pstate=passive",
        "panic=10",
    ]
    assert compose_kernel_args(plan, topology, {"hugepages_per_node": 8, "hugepages_size": "1G"})[
        -3:
    ] == [
        "default_hugepagesz=1G",
        "hugepagesz=1G",
        "hugepages=0:8,1:8",
    ]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"extra": ["isolcpus=1"]}, "conflicts with 'isolcpus=managed_irq"),
        ({"extra": ["BOOT_IMAGE=/x"]}, "distribution's boot entry"),
        ({"extra": ["two words"]}, "must be one word"),
        ({"hugepages_per_node": {"x": 1}}, "not a NUMA node id"),
        ({"hugepages_per_node": -1}, "whole number >= 0"),
        ({"hugepages_size": "4M", "hugepages_per_node": 1}, "use one of 1G, 2M"),
        ({"max_cstate": 12}, "max_cstate must be a whole number 0..9"),
        ({"amd_pstate": "turbo"}, "amd_pstate must be"),
        ({"transparent_hugepage": "sometimes"}, "transparent_hugepage must be"),
    ],
)
def test_compose_refuses_bad_options(epyc, options, message):
    topology, plan = epyc
    with pytest.raises(BootConfigError, match=message.replace("(", r"\(")):
        compose_kernel_args(plan, topology, options)


TUNE = Path(__file__).resolve().parents[2] / "roles/rtfleet_host/files/rtfleet-host-tune"


def _irq_tree(root, irqs):
    for irq, cpus in irqs.items():
        (root / "proc/irq" / str(irq)).mkdir(parents=True)
        (root / "proc/irq" / str(irq) / "smp_affinity_list").write_text(cpus + "\n")
    (root / "proc/irq/default_smp_affinity").write_text("ff\n")
    (root / "proc/sys/kernel").mkdir(parents=True)
    (root / "proc/sys/kernel/numa_balancing").write_text("1\n")
    (root / "proc/sys/kernel/printk").write_text("4\t4\t1\t7\n")
    for cpu in range(4):
        d = root / "sys/devices/system/cpu" / ("cpu%d" % cpu) / "cpufreq"
        d.mkdir(parents=True)
        (d / "scaling_governor").write_text("schedutil\n")
        (d / "scaling_available_governors").write_text("performance schedutil\n")


def _tune(root, config, *extra):
    cfg = root / "tune.json"
    cfg.write_text(json.dumps(config))
    env = {
        **os.environ,
        "RTFLEET_LIB": str(Path(__file__).resolve().parents[2] / "roles/rtfleet_host/files"),
    }
    run = subprocess.run(
        [
            sys.executable,
            str(TUNE),
            "--config",
            str(cfg),
            "--root",
            str(root),
            "--state",
            str(root / "state.json"),
            *extra,
        ],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    return run.returncode, json.loads(run.stdout) if run.returncode == 0 else run.stderr


def test_host_tune_checks_then_applies_then_has_nothing_left(tmp_path):
    _irq_tree(tmp_path, {0: "0", 4: "4", 24: "0-7", 25: "2-3"})
    config = {
        "housekeeping_cpus": "0,4",
        "irq_mode": "static",
        "governor": "performance",
        "sysctls": {"kernel.numa_balancing": 0, "kernel.printk": "4 4 1 7", "kernel.no_such": 1},
    }
    rc, check = _tune(tmp_path, config, "--check")
    assert not (tmp_path / "state.json").exists()
    assert "kernel.numa_balancing = 0" in check["changed"] and check["skipped"] == [
        "sysctl kernel.no_such: not in this kernel"
    ]
    assert rc == 0 and (tmp_path / "proc/irq/24/smp_affinity_list").read_text() == "0-7\n"
    assert (
        "irq 24: 0-7 -> 0,4" in check["changed"]
        and "cpu3 governor -> performance" in check["changed"]
    )
    rc, applied = _tune(tmp_path, config)
    assert rc == 0 and sorted(applied["changed"]) == sorted(check["changed"])
    assert (tmp_path / "proc/irq/25/smp_affinity_list").read_text() == "0,4"
    assert (tmp_path / "proc/irq/default_smp_affinity").read_text() == "11"
    assert (
        tmp_path / "sys/devices/system/cpu/cpu2/cpufreq/scaling_governor"
    ).read_text() == "performance"
    assert (tmp_path / "proc/sys/kernel/numa_balancing").read_text() == "0"
    assert json.loads((tmp_path / "state.json").read_text()) == applied
    again = {
        "changed": [],
        "short": [],
        "skipped": ["sysctl kernel.no_such: not in this kernel"],
        "unmovable": [],
    }
    assert _tune(tmp_path, config) == (0, again)


def test_host_tune_leaves_irqs_to_irqbalance_and_reports_missing_cpufreq(tmp_path):
    (tmp_path / "proc/irq/24").mkdir(parents=True)
    (tmp_path / "proc/irq/24/smp_affinity_list").write_text("0-7\n")
    (tmp_path / "sys/devices/system/cpu/cpu0").mkdir(parents=True)
    rc, out = _tune(
        tmp_path, {"housekeeping_cpus": "0", "irq_mode": "irqbalance", "governor": "performance"}
    )
    assert (
        rc == 0
        and out["changed"] == []
        and out["skipped"] == ["governor: no cpufreq driver on this host"]
    )
    rc, err = _tune(tmp_path, {"irq_mode": "static"})
    assert rc == 2 and "housekeeping_cpus" in err


def test_host_tune_check_trusts_the_last_run_about_unmovable_irqs(tmp_path):
    # A managed (per-queue) IRQ refuses a new affinity; the last real run recorded that.
    _irq_tree(tmp_path, {30: "5", 31: "1-3"})
    (tmp_path / "state.json").write_text(
        json.dumps({"changed": [], "skipped": [], "unmovable": [30]})
    )
    rc, check = _tune(tmp_path, {"housekeeping_cpus": "0,4", "irq_mode": "static"}, "--check")
    assert rc == 0 and check["unmovable"] == [30]
    assert check["changed"] == ["default_smp_affinity=11", "irq 31: 1-3 -> 0,4"]
