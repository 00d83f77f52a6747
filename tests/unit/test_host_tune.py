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

from rtfleet.planner import plan_partition
from rtfleet.topology import parse_cpulist, read_topology

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
    env = {**os.environ, "RTFLEET_LIB": str(REPO / "plugins/module_utils")}
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
