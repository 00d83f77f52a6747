"""rtfleet-host-tune on server-sized trees: a generated host goes through topology -> plan ->
tune.json (as the host role writes it from the plan record) -> the tuner, and what it writes
into /proc is held to the kernel's own parsing rules (lib/bitmap-str.c ``bitmap_parse`` for
hex masks, ``bitmap_parselist`` for cpulists), which refuse what a plain file would take."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from sysfs_gen import build_tree

from rtfleet.boot import compose_kernel_args, hugepage_runtime_settings
from rtfleet.cpulist import parse_cpulist
from rtfleet.planner import plan_partition
from rtfleet.topology import read_topology

REPO = Path(__file__).resolve().parents[2]
TUNE = REPO / "roles/rtfleet_host/files/rtfleet-host-tune"


def kernel_bitmap_parse(text, nbits):
    """The kernel's rules for writing /proc/irq/*smp_affinity: comma-separated 32-bit groups
    of at most 8 hex digits, no bit at or above nr_cpu_ids; anything else is EOVERFLOW or
    EINVAL (seen on a 48-vCPU guest: ``10000000000000001`` -> I/O error)."""
    text = text.strip()
    groups = text.split(",")
    value = 0
    for group in groups:
        if not re.fullmatch(r"[0-9a-fA-F]{1,8}", group):
            raise OSError(f"kernel refuses mask {text!r}: group {group!r}")
        value = (value << 32) | int(group, 16)
    if value >> nbits:
        raise OSError(f"kernel refuses mask {text!r}: bits beyond nr_cpu_ids={nbits}")
    return sorted(bit for bit in range(nbits) if value >> bit & 1)


def kernel_bitmap_parselist(text, nbits):
    """``bitmap_parselist``: no spaces inside, no empty items, ranges within nr_cpu_ids."""
    text = text.strip()
    if not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", text):
        raise OSError(f"kernel refuses cpulist {text!r}")
    cpus = parse_cpulist(text)
    if cpus and cpus[-1] >= nbits:
        raise OSError(f"kernel refuses cpulist {text!r}: CPU beyond nr_cpu_ids={nbits}")
    return cpus


def _fake_proc(root, nbits, irqs):
    """/proc/irq as a booted big host shows it: every IRQ on every CPU."""
    everything = "0-%d" % (nbits - 1)
    full = ",".join(["ffffffff"] * (nbits // 32)) or "0"
    if nbits % 32:
        full = ("%x" % ((1 << (nbits % 32)) - 1)) + ("," + full if nbits >= 32 else "")
    (root / "proc/irq").mkdir(parents=True, exist_ok=True)
    (root / "proc/irq/default_smp_affinity").write_text(full + "\n")
    for irq in irqs:
        (root / "proc/irq" / str(irq)).mkdir()
        (root / "proc/irq" / str(irq) / "smp_affinity_list").write_text(everything + "\n")
    (root / "proc/sys/kernel").mkdir(parents=True, exist_ok=True)
    (root / "proc/sys/kernel/numa_balancing").write_text("1\n")


def _run_tuner(root, config, *extra):
    cfg = root / "tune.json"
    cfg.write_text(json.dumps(config))
    env = {**os.environ, "RTFLEET_LIB": str(REPO / "roles/rtfleet_host/files")}
    argv = [sys.executable, str(TUNE), "--config", str(cfg), "--root", str(root)]
    return subprocess.run(
        [*argv, "--state", str(root / "state.json"), *extra],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("shape", "policy"),
    [
        # 2 sockets x 84 cores x SMT2 = 336 CPUs, housekeeping on every node
        ("epyc-9634-2s", {"housekeeping_cores_per_node": 1}),
        # 2-socket Xeon with SMT: housekeeping that includes CPUs >= 32 (the second socket)
        ("xeon-2s-smt", {"housekeeping_cores_per_node": 1}),
        # NPS4: 4 nodes a socket, a housekeeping core on each
        ("epyc-7702p-nps4", {"housekeeping_cores_per_node": 1}),
    ],
)
def test_tuner_writes_what_the_kernel_accepts_on_big_hosts(tmp_path, shape, policy):
    root = build_tree(shape, tmp_path / "host")
    topology = read_topology(str(root))
    plan = plan_partition(topology, policy)
    nbits = max(topology["present_cpus"]) + 1
    assert max(plan["housekeeping"]) >= 32, "the case that broke: a housekeeping CPU >= 32"
    _fake_proc(root, nbits, irqs=[0, 1, 24, 120])
    # What the host role writes (roles/rtfleet_host/vars/main.yml): read from the plan record.
    config = {
        "housekeeping_cpus": plan["cpulists"]["housekeeping"],
        "irq_default_affinity_mask": plan["irq_default_affinity_mask"],
        "irq_mode": "static",
        "sysctls": {"kernel.numa_balancing": 0},
    }
    check = _run_tuner(root, config, "--check")
    assert check.returncode == 0, check.stderr
    run = _run_tuner(root, config)
    assert run.returncode == 0, run.stderr
    written = (root / "proc/irq/default_smp_affinity").read_text()
    assert kernel_bitmap_parse(written, nbits) == plan["housekeeping"]
    for irq in (0, 1, 24, 120):
        text = (root / "proc/irq" / str(irq) / "smp_affinity_list").read_text()
        assert kernel_bitmap_parselist(text, nbits) == plan["housekeeping"]
    # Nothing left to do: the second run (and its check) changes nothing.
    again = _run_tuner(root, config, "--check")
    assert json.loads(again.stdout)["changed"] == []


def test_kernel_rules_refuse_the_old_single_word_mask():
    # The tuner used to write "%x": one word of 17 digits for CPUs 0 and 64.
    with pytest.raises(OSError, match="group"):
        kernel_bitmap_parse("10000000000000001", 72)
    assert kernel_bitmap_parse("1,00000000,00000001", 72) == [0, 64]


def test_tuner_refuses_a_mask_that_disagrees_with_the_cpulist(tmp_path):
    _fake_proc(tmp_path, 64, irqs=[0])
    run = _run_tuner(
        tmp_path,
        {"housekeeping_cpus": "0,32", "irq_default_affinity_mask": "1", "irq_mode": "static"},
    )
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "is not housekeeping_cpus 0,32" in run.stderr
    assert (tmp_path / "proc/irq/default_smp_affinity").read_text().startswith("ffffffff")


def test_tuner_refuses_a_bad_cpulist_in_one_line(tmp_path):
    _fake_proc(tmp_path, 8, irqs=[0])
    run = _run_tuner(tmp_path, {"housekeeping_cpus": "0-x", "irq_mode": "static"})
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize(
    ("shape", "per_node", "want"),
    [
        # 8 nodes of CPUs and memory + 2 CPU-less CXL memory nodes: pages on the 8 only
        ("epyc-9354-2s-nps4-cxl", 64, dict.fromkeys(range(8), 64)),
        # socket 0 without DIMMs (node 0 offline): its pages live on node 1
        ("xeon-2s-memoryless-node0", {"1": 128}, {1: 128}),
    ],
)
def test_tuner_allocates_2m_hugepages_per_node_at_runtime(tmp_path, shape, per_node, want):
    root = build_tree(shape, tmp_path / "host")
    topology = read_topology(str(root))
    plan = plan_partition(topology, {"housekeeping_cores_per_node": 1})
    # What the role writes into tune.json (roles/rtfleet_host/vars/main.yml), and the
    # command line it composes for the same settings: 2M pages are not on it.
    hugepages = hugepage_runtime_settings(topology, "2M", per_node)
    args = compose_kernel_args(plan, topology, {"hugepages_per_node": per_node})
    assert not [a for a in args if a.startswith(("hugepages", "hugepagesz", "default_hugepagesz"))]
    nodes = root / "sys/devices/system/node"
    pools = {
        int(d.name[4:]): d / "hugepages/hugepages-2048kB/nr_hugepages"
        for d in nodes.glob("node[0-9]*")
    }
    for pool in pools.values():  # a freshly booted host: no pages yet
        pool.write_text("0\n")
    _fake_proc(root, max(topology["present_cpus"]) + 1, irqs=[0])
    config = {
        "housekeeping_cpus": plan["cpulists"]["housekeeping"],
        "irq_default_affinity_mask": plan["irq_default_affinity_mask"],
        "irq_mode": "static",
        "hugepages": hugepages,
    }
    check = _run_tuner(root, config, "--check")
    assert check.returncode == 0, check.stderr
    assert all(p.read_text() == "0\n" for p in pools.values()), "--check wrote a pool"
    run = _run_tuner(root, config)
    assert run.returncode == 0, run.stderr
    got = {node: int(pool.read_text()) for node, pool in pools.items()}
    assert got == {node: want.get(node, 0) for node in pools}
    assert json.loads(run.stdout)["short"] == []
    again = _run_tuner(root, config, "--check")
    assert [c for c in json.loads(again.stdout)["changed"] if "hugepages" in c] == []


def test_1g_hugepages_stay_on_the_command_line(tmp_path):
    root = build_tree("epyc-9634-2s", tmp_path / "host")
    topology = read_topology(str(root))
    plan = plan_partition(topology, {"housekeeping_cores_per_node": 1})
    options = {"hugepages_size": "1G", "hugepages_per_node": 4}
    args = compose_kernel_args(plan, topology, options)
    assert "hugepagesz=1G" in args and "hugepages=0:4,1:4" in args
    assert hugepage_runtime_settings(topology, "1G", 4) == {}


@pytest.mark.parametrize(
    "hugepages",
    [
        {"size_kb": 2048},  # no per_node
        {"size_kb": "2M", "per_node": {"0": 64}},
        {"size_kb": 2048, "per_node": [64, 64]},
        {"size_kb": 2048, "per_node": {"0": -1}},
    ],
)
def test_tuner_refuses_malformed_hugepages_in_one_line_and_writes_nothing(tmp_path, hugepages):
    root = build_tree("epyc-9354-2s-nps4-cxl", tmp_path / "host")
    plan = plan_partition(read_topology(str(root)), {"housekeeping_cores_per_node": 1})
    pool = root / "sys/devices/system/node/node0/hugepages/hugepages-2048kB/nr_hugepages"
    before = pool.read_text()
    _fake_proc(root, 128, irqs=[0])
    config = {
        "housekeeping_cpus": plan["cpulists"]["housekeeping"],
        "irq_default_affinity_mask": plan["irq_default_affinity_mask"],
        "irq_mode": "static",
        "sysctls": {"kernel.numa_balancing": 0},
        "hugepages": hugepages,
    }
    run = _run_tuner(root, config)
    assert run.returncode == 2
    assert len(run.stderr.strip().splitlines()) == 1 and "hugepages" in run.stderr
    assert pool.read_text() == before
    assert (root / "proc/sys/kernel/numa_balancing").read_text() == "1\n"  # nothing applied


@pytest.mark.skipif(os.geteuid() != 0, reason="sets a sysctl (to the value it has) as root")
def test_a_sysctl_the_running_kernel_lacks_is_persisted_and_not_set(tmp_path):
    """The host role's sysctl step on this machine's own kernel: a key it has not (as
    kernel.numa_balancing on a PREEMPT_RT kernel, which failed a site run on the drills' lab
    host) is written for early boot only; one it has is set (to the value it already holds,
    so this machine does not change) and written."""
    from conftest import REPO, run_local_playbook

    have = Path("/proc/sys/vm/swappiness").read_text().strip()
    rt = Path("/proc/sys/kernel/sched_rt_runtime_us").read_text().strip()
    conf = tmp_path / "90-rtfleet.conf"
    play = [
        {
            "hosts": "localhost",
            "gather_facts": False,
            "tasks": [
                {
                    "ansible.builtin.include_role": {
                        "name": "rtfleet.fleet.rtfleet_host",
                        "tasks_from": "sysctls",
                    },
                    "vars": {
                        "rtfleet_host_sysctls": {
                            "kernel.rtfleet_no_such_knob": 0,
                            "vm.swappiness": have,
                        },
                        "rtfleet_host_sysctls_extra": {},
                        "rtfleet_host_sched_rt_runtime_us": rt,
                    },
                }
            ],
        }
    ]
    playbook = tmp_path / "sysctls.yml"
    playbook.write_text(json.dumps(play))
    run = run_local_playbook(playbook, "-e", f"__rtfleet_host_sysctl_file={conf}")
    assert run.returncode == 0, run.stdout[-3000:]
    assert "kernel.rtfleet_no_such_knob=0 (not in this kernel: persisted only)" in run.stdout
    lines = set(conf.read_text().splitlines())
    assert {"kernel.rtfleet_no_such_knob=0", f"vm.swappiness={have}"} <= lines, lines
    assert Path("/proc/sys/vm/swappiness").read_text().strip() == have
    again = run_local_playbook(playbook, "-e", f"__rtfleet_host_sysctl_file={conf}")
    assert again.returncode == 0 and "changed=0" in again.stdout, again.stdout[-3000:]
    assert REPO.joinpath("roles/rtfleet_host/tasks/sysctls.yml").is_file()
