"""rtfleet-drift on server-sized trees: a generated (or captured) host is planned, its records
written as the host role writes them, its /proc, /sys, cgroups and units faked in a tree, and
then drifted one way at a time. The guard must find each drift, re-pin moved IRQs with the
tuner's code (what it writes held to the kernel's parsing rules), report IRQs the kernel
refuses to move as unmovable, write a textfile Prometheus' own parser accepts, write nothing
with --check, and refuse broken records in one line with exit 2, writing nothing."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sysfs_gen import build_tree, load_shape
from test_host_tune import kernel_bitmap_parse, kernel_bitmap_parselist

from rtfleet import drift, drift_units, hosttune
from rtfleet.boot import compose_kernel_args, hugepage_runtime_settings, isolation_expected
from rtfleet.cpulist import format_cpulist, format_cpumask, parse_cpulist
from rtfleet.plan_record import to_record
from rtfleet.planner import plan_partition
from rtfleet.topology import read_topology

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "roles/rtfleet_host/files/rtfleet-drift"
CAPTURED = REPO / "tests/fixtures/sysfs/lab-server-nps2.tar.gz"
IRQS = (0, 1, 4, 8, 9, 24, 25, 120, 121, 122)
SYSCTLS = {"kernel.numa_balancing": 0, "vm.swappiness": 10, "kernel.sched_rt_runtime_us": -1}
KUBELET = "etc/kubernetes/kubelet.conf.d/90-rtfleet.conf"
TEXTFILE = "var/lib/prometheus/node-exporter/rtfleet_drift.prom"
RESULT = "var/lib/rtfleet/drift.json"

_FAKE_SYSTEMCTL = """#!%s
import json, os, sys
state = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "systemctl.json")))
props = sys.argv[2].split("=", 1)[1].split(",")
blocks = []
for unit in sys.argv[4:]:
    shown = state.get(unit, {"LoadState": "not-found", "ActiveState": "inactive"})
    shown["Id"] = unit
    blocks.append("\\n".join("%%s=%%s" %% (p, shown.get(p, "")) for p in props))
print("\\n\\n".join(blocks))
"""


def _big_shape():
    """2 sockets, 128 CPUs with SMT, 10 NUMA nodes: 8 with CPUs (node 1 without memory, a
    socket quadrant without DIMMs) and 2 CPU-less CXL memory nodes."""
    shape = load_shape("epyc-9354-2s-nps4-cxl")
    shape.update(memoryless_nodes=[1], memoryless_style="online")
    return shape


def _stat(tid, comm, cpu):
    fields = [str(tid), "(%s)" % comm, "S"] + ["0"] * 49
    fields[38] = str(cpu)  # field 39: the CPU the task last ran on
    return " ".join(fields) + "\n"


class Host:
    """A tree that looks like a tuned host to the guard (``--root``)."""

    def __init__(self, root, policy):
        self.root = Path(root)
        self.topology = read_topology(str(self.root))
        self.plan = plan_partition(self.topology, policy)
        self.housekeeping = self.plan["cpulists"]["housekeeping"]
        self.args = compose_kernel_args(self.plan, self.topology, {"hugepages_per_node": 0})
        nodes = [n["id"] for n in self.topology["numa_nodes"] if n["cpus"] and n["has_memory"]]
        self.tune = {
            "housekeeping_cpus": self.housekeeping,
            "irq_default_affinity_mask": self.plan["irq_default_affinity_mask"],
            "irq_mode": "static",
            "governor": "performance",
            "sysctls": SYSCTLS,
            "hugepages": hugepage_runtime_settings(
                self.topology, "2M", {str(n): 16 for n in nodes}
            ),
        }
        self.record = {
            "kernel_args": self.args,
            "irq_mode": "static",
            "tuned_profile": None,
            "sysctls": SYSCTLS,
        }
        self.write_records()
        self.boot()
        self.irqs()
        self.sysctls()
        self.pages()
        self.units = self.runtime()
        # As rtfleet_kubelet writes it: a comment header, then JSON.
        self.put(
            KUBELET,
            "# Managed by rtfleet (role rtfleet_kubelet).\n"
            + json.dumps({"kind": "KubeletConfiguration", **self.plan["kubelet"]}, indent=2),
        )
        self.put("etc/default/irqbalance", "#IRQBALANCE_BANNED_CPULIST=\n")
        self.put("run/rtfleet/tune-state.json", json.dumps({"unmovable": []}))
        self.systemctl = self.root / "fake-systemctl"
        self.systemctl.write_text(_FAKE_SYSTEMCTL % sys.executable)
        self.systemctl.chmod(0o755)
        self.write_units()

    def put(self, rel, text):
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def write_records(self):
        self.put("etc/rtfleet/plan.json", json.dumps(to_record(self.plan), indent=2))
        self.put("etc/rtfleet/host.json", json.dumps(self.record, indent=2))
        self.put("etc/rtfleet/tune.json", json.dumps(self.tune, indent=2))

    def boot(self):
        self.put("proc/cmdline", "BOOT_IMAGE=/vmlinuz root=UUID=x ro quiet " + " ".join(self.args))
        expected = isolation_expected(self.args)
        self.put("sys/devices/system/cpu/isolated", expected["isolated"] + "\n")
        self.put("sys/devices/system/cpu/nohz_full", expected["nohz_full"] + "\n")

    def irqs(self):
        self.put("proc/irq/default_smp_affinity", self.plan["irq_default_affinity_mask"] + "\n")
        for irq in IRQS:
            self.put("proc/irq/%d/smp_affinity_list" % irq, self.housekeeping + "\n")
            first = self.plan["housekeeping"][irq % len(self.plan["housekeeping"])]
            self.put("proc/irq/%d/effective_affinity_list" % irq, "%d\n" % first)
            (self.root / ("proc/irq/%d/virtio%d-input.0" % (irq, irq))).mkdir()

    def sysctls(self):
        for key, value in SYSCTLS.items():
            self.put("proc/sys/" + key.replace(".", "/"), "%s\n" % value)

    def pages(self):
        for node, count in self.tune["hugepages"]["per_node"].items():
            rel = "sys/devices/system/node/node%s/hugepages/hugepages-2048kB/nr_hugepages" % node
            self.put(rel, "%d\n" % count)

    def runtime(self):
        """Every runtime group's unit running: two processes of three threads, on its CPUs."""
        units = {}
        self.put("etc/systemd/system/shminfer@.service", "[Service]\n")
        pid = 1000
        for group in self.plan["runtime_groups"]:
            unit = "shminfer@%s.service" % group["name"]
            cgroup = "/rtfleet.slice/%s" % unit
            pids = []
            for proc in range(2):
                pid += 10
                pids.append(pid)
                for n in range(3):
                    tid = pid + n
                    base = "proc/%d/task/%d" % (pid, tid)
                    self.put(
                        base + "/status", "Name:\tw\nCpus_allowed_list:\t%s\n" % group["cpulist"]
                    )
                    comm = "shminfer worker (%d)" % proc if n == 0 else "ov:thread %d" % n
                    self.put(
                        base + "/stat", _stat(tid, comm, group["cpus"][n % len(group["cpus"])])
                    )
            self.put("sys/fs/cgroup%s/cgroup.procs" % cgroup, "".join("%d\n" % p for p in pids))
            units[unit] = {
                "LoadState": "loaded",
                "ActiveState": "active",
                "UnitFileState": "enabled",
                "MainPID": str(pids[0]),
                "ControlGroup": cgroup,
                # systemctl prints cpusets space-separated
                "CPUAffinity": " ".join(format_cpulist(group["cpus"]).split(",")),
                "NUMAPolicy": "bind",
                "NUMAMask": str(group["memory_node"]),
            }
        units["irqbalance.service"] = {"LoadState": "not-found", "ActiveState": "inactive"}
        return units

    def write_units(self):
        (self.root / "systemctl.json").write_text(json.dumps(self.units))

    def run(self, *extra, check=False):
        argv = ["--root", str(self.root), "--systemctl", str(self.systemctl), "--json", *extra]
        if check:
            argv.append("--check")
        return drift.main(argv)


@pytest.fixture
def big():
    """The 128-CPU, 10-node host, a fresh tree for every test (tmpfs: ~7500 small files)."""
    shm = Path("/dev/shm")
    base = Path(tempfile.mkdtemp(prefix="drift-", dir=shm if os.access(shm, os.W_OK) else None))
    try:
        root = build_tree(_big_shape(), base / "host")
        yield Host(root, {"housekeeping_cores_per_node": 1, "runtime_l3_groups": 8})
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def captured_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab-server-nps2")
    with tarfile.open(CAPTURED) as tar:
        tar.extractall(root, filter="data")
    return root


def _result(capsys):
    return json.loads(capsys.readouterr().out)


def _statuses(result):
    return {name: check["status"] for name, check in result["checks"].items()}


def _metrics(text):
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_a_tuned_host_has_no_drift_and_gets_a_valid_textfile(big, capsys):
    assert big.run() == 0
    result = _result(capsys)
    assert result["schema"] == 1 and result["drift"] is False and result["mode"] == "repair"
    assert sorted(result["checks"]) == sorted(drift.CHECKS)
    statuses = _statuses(result)
    assert statuses.pop("tuned") == "skipped" and statuses.pop("governor") == "skipped"
    assert set(statuses.values()) == {"ok"}, result
    threads = result["checks"]["unit_threads"]["units"]
    assert len(threads) == len(big.plan["runtime_groups"])
    assert all(
        u["threads"] == 6 and u["processes"] == 2 and u["outside"] == [] for u in threads.values()
    )
    text = (big.root / TEXTFILE).read_text()
    metrics = _metrics(text)
    for name in drift.CHECKS:
        assert metrics[("rtfleet_drift", (("check", name),))] == 0
    assert metrics[("rtfleet_drift_repinned_irqs_total", ())] == 0
    stamp = metrics[("rtfleet_check_last_success_timestamp_seconds", (("tool", "rtfleet-drift"),))]
    assert stamp == pytest.approx(result["timestamp"], abs=0.01)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["rtfleet_drift"].type == "gauge" and families["rtfleet_drift"].documentation
    assert families["rtfleet_drift_repinned_irqs"].type == "counter"
    assert json.loads((big.root / RESULT).read_text())["checks"] == result["checks"]
    # Atomic writes leave no temporary file beside the results.
    assert sorted(p.name for p in (big.root / TEXTFILE).parent.iterdir()) == ["rtfleet_drift.prom"]


def test_a_moved_irq_is_repinned_with_cpus_past_32_and_64(big, capsys):
    isolated = big.plan["isolated"]
    high = [c for c in isolated if c >= 64][:2]
    big.put("proc/irq/24/smp_affinity_list", format_cpulist(high) + "\n")
    # An IRQ that appeared after boot, on an isolated CPU past 32.
    big.put("proc/irq/200/smp_affinity_list", "%d\n" % next(c for c in isolated if c >= 32))
    big.put("proc/irq/default_smp_affinity", format_cpumask(big.plan["online"]) + "\n")
    nbits = max(big.topology["present_cpus"]) + 1

    assert big.run(check=True) == 1
    checked = _result(capsys)["checks"]["irqs"]
    assert checked["status"] == "drift" and checked["repinned"] == []
    assert {m["irq"] for m in checked["would_repin"]} == {"default", 24, 200}
    assert (big.root / "proc/irq/24/smp_affinity_list").read_text() == format_cpulist(high) + "\n"

    assert big.run() == 0  # nothing left after the re-pin
    out = capsys.readouterr()
    result = json.loads(out.out)
    irqs = result["checks"]["irqs"]
    assert irqs["status"] == "repaired"
    moved = {m["irq"]: m for m in irqs["repinned"]}
    assert moved[24]["from"] == format_cpulist(high) and moved[24]["to"] == big.housekeeping
    assert moved[24]["actions"] == ["virtio24-input.0"]
    for irq in (24, 200):
        text = (big.root / ("proc/irq/%d/smp_affinity_list" % irq)).read_text()
        assert kernel_bitmap_parselist(text, nbits) == big.plan["housekeeping"]
    mask = (big.root / "proc/irq/default_smp_affinity").read_text()
    assert kernel_bitmap_parse(mask, nbits) == big.plan["housekeeping"]
    assert len(mask.strip().split(",")) == 4  # 128 CPUs: four 32-bit groups
    assert (
        "re-pinned IRQ 24 (virtio24-input.0) from %s to %s" % (moved[24]["from"], big.housekeeping)
        in out.err
    )
    metrics = _metrics((big.root / TEXTFILE).read_text())
    assert metrics[("rtfleet_drift_repinned_irqs_total", ())] == 2
    assert metrics[("rtfleet_drift", (("check", "irqs"),))] == 0
    # The counter carries over from the last result; the next run finds nothing to do.
    big.put("proc/irq/25/smp_affinity_list", "%d\n" % high[0])
    assert big.run() == 0
    capsys.readouterr()
    assert (
        _metrics((big.root / TEXTFILE).read_text())[("rtfleet_drift_repinned_irqs_total", ())] == 3
    )


def test_a_per_cpu_irq_the_kernel_refuses_is_unmovable_not_drift(big, capsys, monkeypatch):
    cpu = big.plan["isolated"][-1]
    big.put("proc/irq/121/smp_affinity_list", "%d\n" % cpu)
    real_write = hosttune.write

    def refusing(path, value):
        if path.endswith("/121/smp_affinity_list"):
            raise OSError(errno.EIO, "Input/output error")
        real_write(path, value)

    monkeypatch.setattr(hosttune, "write", refusing)
    assert big.run() == 0
    irqs = _result(capsys)["checks"]["irqs"]
    assert irqs["status"] == "ok" and irqs["unmovable"] == [121] and irqs["repinned"] == []
    assert any("unmovable" in d and "121" in d for d in irqs["details"])
    metrics = _metrics((big.root / TEXTFILE).read_text())
    assert metrics[("rtfleet_drift_unmovable_irqs", ())] == 1
    # --check cannot try: the last run's result says which IRQs the kernel refused.
    assert big.run(check=True) == 0
    assert _result(capsys)["checks"]["irqs"]["unmovable"] == [121]


def _drop_cmdline_arg(host):
    host.put("proc/cmdline", " ".join(a for a in host.args if not a.startswith("nohz_full")))


def _nohz_differs(host):
    host.put("sys/devices/system/cpu/nohz_full", "%d\n" % host.plan["isolated"][0])


def _effective_outside(host):
    host.put("proc/irq/8/effective_affinity_list", "%d\n" % host.plan["isolated"][3])


def _irqbalance_running(host):
    host.units["irqbalance.service"] = {
        "LoadState": "loaded",
        "ActiveState": "active",
        "UnitFileState": "enabled",
        "MainPID": "4242",
    }
    host.write_units()


def _irqbalance_mode_without_ban(host):
    host.tune["irq_mode"] = "irqbalance"
    host.write_records()
    host.put(
        "etc/default/irqbalance",
        "IRQBALANCE_BANNED_CPULIST=%s\n" % host.plan["irqbalance_banned_cpus"],
    )
    host.put("proc/4242/environ", "PATH=/usr/bin\x00IRQBALANCE_BANNED_CPULIST=\x00")
    _irqbalance_running(host)


def _tuned_profile_differs(host):
    host.record["tuned_profile"] = "rtfleet"
    host.write_records()
    host.put("etc/tuned/active_profile", "balanced\n")
    host.units["tuned.service"] = {"LoadState": "loaded", "ActiveState": "active"}
    host.write_units()


def _sysctl_changed(host):
    host.put("proc/sys/vm/swappiness", "60\n")


def _hugepages_changed(host):
    host.put("sys/devices/system/node/node7/hugepages/hugepages-2048kB/nr_hugepages", "3\n")


def _unit_affinity_differs(host):
    unit = "shminfer@%s.service" % host.plan["runtime_groups"][1]["name"]
    host.units[unit]["CPUAffinity"] = "0-127"
    host.write_units()


def _unit_numa_differs(host):
    # Group 1 sits on the memoryless node 1: the plan binds it to node 0, not its own node.
    group = next(g for g in host.plan["runtime_groups"] if g["numa_node"] == 1)
    assert group["memory_node"] == 0
    host.units["shminfer@%s.service" % group["name"]]["NUMAMask"] = "1"
    host.write_units()


def _unit_stopped(host):
    unit = "shminfer@%s.service" % host.plan["runtime_groups"][0]["name"]
    host.units[unit]["ActiveState"] = "failed"
    host.write_units()
    host.put("sys/fs/cgroup%s/cgroup.procs" % host.units[unit]["ControlGroup"], "")


def _thread_allowed_outside(host):
    pid = _first_pid(host)
    host.put("proc/%d/task/%d/status" % (pid, pid + 1), "Cpus_allowed_list:\t0-127\n")


def _thread_ran_outside(host):
    pid = _first_pid(host)
    host.put("proc/%d/task/%d/stat" % (pid, pid + 2), _stat(pid + 2, "ov:thread 2", 64))


def _first_pid(host):
    unit = "shminfer@%s.service" % host.plan["runtime_groups"][0]["name"]
    return int(host.units[unit]["MainPID"])


def _kubelet_differs(host):
    host.put(KUBELET, '# a YAML drop-in\nkind: KubeletConfiguration\nreservedSystemCPUs: "0-7"\n')


def _kubelet_unset(host):
    host.put(KUBELET, json.dumps({"kind": "KubeletConfiguration", "cpuManagerPolicy": "none"}))


@pytest.mark.parametrize(
    ("cause", "check", "needle"),
    [
        (_drop_cmdline_arg, "cmdline", "/proc/cmdline lacks nohz_full="),
        (_nohz_differs, "isolation", "nohz_full is"),
        (_effective_outside, "irqs", "IRQ 8 effective affinity"),
        (_irqbalance_running, "irqbalance", "irqbalance is running"),
        (
            _irqbalance_mode_without_ban,
            "irqbalance",
            "the running irqbalance (pid 4242) bans nothing",
        ),
        (_tuned_profile_differs, "tuned", "'balanced'"),
        (_sysctl_changed, "sysctls", "vm.swappiness is 60, wanted 10"),
        (_hugepages_changed, "hugepages", "node 7 has 3 x 2048 kB pages, wanted 16"),
        (_unit_affinity_differs, "units", "CPUAffinity is 0-127"),
        (_unit_numa_differs, "units", "NUMA policy is bind:1, the plan's bind:0"),
        (_unit_stopped, "units", "is failed"),
        (_thread_allowed_outside, "unit_threads", "may run outside"),
        (_thread_ran_outside, "unit_threads", "last ran on CPU 64"),
        (_kubelet_differs, "kubelet", "reservedSystemCPUs is 0-7"),
        (_kubelet_unset, "kubelet", "sets no reservedSystemCPUs"),
    ],
)
def test_each_kind_of_drift_is_reported_and_left_alone(big, capsys, cause, check, needle):
    cause(big)
    before = _snapshot(big.root, exclude=("var/lib",))
    assert big.run() == 1
    result = _result(capsys)
    drifted = {name for name, status in _statuses(result).items() if status == "drift"}
    if cause is _unit_stopped:
        assert drifted == {"units", "unit_threads"}  # a stopped unit's threads are gone too
    else:
        assert drifted == {check}, result["checks"]
    assert any(needle in d for d in result["checks"][check]["details"]), result["checks"][check]
    assert result["drift"] is True and result["exit_code"] == 1
    metrics = _metrics((big.root / TEXTFILE).read_text())
    assert metrics[("rtfleet_drift", (("check", check),))] == 1
    # Only IRQs are ever repaired; everything else is reported.
    assert _snapshot(big.root, exclude=("var/lib", "run/rtfleet")) == {
        k: v for k, v in before.items() if not k.startswith("run/rtfleet")
    }


def test_unit_threads_json_is_what_the_postcheck_reads(big, capsys):
    _thread_ran_outside(big)
    _thread_allowed_outside(big)
    big.run(check=True)
    section = _result(capsys)["checks"]["unit_threads"]
    assert section["status"] == "drift"
    unit = "shminfer@%s.service" % big.plan["runtime_groups"][0]["name"]
    report = section["units"][unit]
    assert set(report) == {"group", "cpus", "active", "processes", "threads", "outside"}
    assert report["cpus"] == big.plan["runtime_groups"][0]["cpulist"] and report["active"]
    pid = _first_pid(big)
    assert report["outside"] == [
        {"pid": pid, "tid": pid + 1, "comm": "ov:thread 1", "cpus_allowed": "0-127",
         "last_cpu": big.plan["runtime_groups"][0]["cpus"][1], "why": ["allowed"]},
        {"pid": pid, "tid": pid + 2, "comm": "ov:thread 2",
         "cpus_allowed": big.plan["runtime_groups"][0]["cpulist"], "last_cpu": 64, "why": ["ran"]},
    ]  # fmt: skip


def test_thread_containment_reads_comm_with_spaces_and_parens(tmp_path):
    (tmp_path / "proc/7/task/7").mkdir(parents=True)
    (tmp_path / "proc/7/task/7/status").write_text("Cpus_allowed_list:\t64-65\n")
    (tmp_path / "proc/7/task/7/stat").write_text(_stat(7, "a) (b c", 65))
    (tmp_path / "proc/7/task/9").mkdir()  # a thread that ended while being read
    found = drift_units.thread_containment(str(tmp_path), [7, 8], [64, 65])
    assert found == {"processes": 1, "threads": 1, "outside": []}
    found = drift_units.thread_containment(str(tmp_path), [7], [64])
    assert found["outside"][0]["comm"] == "a) (b c" and found["outside"][0]["why"] == [
        "allowed",
        "ran",
    ]


def _snapshot(root, exclude=()):
    files = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if not rel.startswith(exclude) and not path.is_symlink():
                files[rel] = (path.read_bytes(), path.stat().st_mtime_ns)
    return files


def test_check_writes_nothing(big, capsys):
    big.put("proc/irq/9/smp_affinity_list", "%d\n" % big.plan["isolated"][5])
    _sysctl_changed(big)
    before = _snapshot(big.root)
    assert big.run(check=True) == 1
    assert _statuses(_result(capsys))["irqs"] == "drift"
    assert _snapshot(big.root) == before
    assert not (big.root / TEXTFILE).exists() and not (big.root / RESULT).exists()


@pytest.mark.parametrize(
    ("record", "content"),
    [
        ("etc/rtfleet/plan.json", '{"housekeeping": [0, 8], "isolated": [1'),  # truncated
        ("etc/rtfleet/plan.json", "\x00\x13garbage"),
        ("etc/rtfleet/plan.json", '{"housekeeping": "0,8", "isolated": [], "runtime_groups": []}'),
        ("etc/rtfleet/plan.json", "[1, 2, 3]"),
        ("etc/rtfleet/tune.json", '{"housekeeping_cpus": "0-x"}'),
        ("etc/rtfleet/tune.json", '{"housekeeping_cpus": "0,8", "hugepages": {"size_kb": 2048'),
        ("etc/rtfleet/tune.json", ""),
        ("etc/rtfleet/host.json", '{"kernel_args": "isolcpus=1"}'),
        ("etc/rtfleet/host.json", None),  # missing
    ],
)
def test_broken_records_are_refused_in_one_line_and_nothing_is_written(
    big, capsys, record, content
):
    big.put("proc/irq/9/smp_affinity_list", "%d\n" % big.plan["isolated"][5])
    if content is None:
        (big.root / record).unlink()
    else:
        big.put(record, content)
    before = _snapshot(big.root)
    assert big.run() == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.count("\n") == 1 and str(big.root / record) in out.err, out.err
    assert "Traceback" not in out.err
    assert _snapshot(big.root) == before


def test_a_relative_textfile_dir_is_refused(big, capsys):
    assert big.run("--textfile-dir", "node-exporter") == 2
    assert "--textfile-dir node-exporter is not absolute" in capsys.readouterr().err


def test_the_installed_script_runs_on_the_nodes_python_with_the_role_files(big):
    """As on a node: /usr/bin/python3 (no rtfleet package) and the role's files as the lib."""
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    big.put("proc/irq/9/smp_affinity_list", "%d\n" % big.plan["isolated"][5])
    # No PYTHONPATH: the script finds its modules through RTFLEET_LIB, as on a node.
    env = {"PATH": os.environ["PATH"], "RTFLEET_LIB": str(REPO / "roles/rtfleet_host/files")}
    argv = [python, str(SCRIPT), "--root", str(big.root), "--systemctl", str(big.systemctl)]
    run = subprocess.run(argv, capture_output=True, text=True, env=env, check=False, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "re-pinned IRQ 9" in run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].split()[:3] == ["irqs", "repaired", "IRQ"] and "IRQ 9" in lines[0]
    assert lines[-1] == "rtfleet-drift: no drift (1 IRQs re-pinned)"
    text = (big.root / "proc/irq/9/smp_affinity_list").read_text()
    assert parse_cpulist(text) == big.plan["housekeeping"]


def test_captured_lab_server_tree(captured_root, tmp_path, capsys):
    """The real 48-vCPU lab guest's sysfs: the lab's policy, a moved IRQ and a drifted sysctl."""
    root = tmp_path / "host"
    shutil.copytree(captured_root, root, symlinks=True)
    policy = {
        "housekeeping_cores_per_node": 1,
        "runtime_l3_groups": "all",
        "partial_l3_groups": "pod_pool",
        "runtime_threads": "one_thread_per_core",
    }
    host = Host(root, policy)
    assert host.housekeeping == "0-1,12-13,24-25,36-37"
    assert host.run() == 0
    capsys.readouterr()
    host.put("proc/irq/24/smp_affinity_list", "40-41\n")
    _sysctl_changed(host)
    assert host.run() == 1
    result = _result(capsys)
    assert {k for k, v in _statuses(result).items() if v in ("drift", "repaired")} == {
        "irqs",
        "sysctls",
    }
    assert result["checks"]["irqs"]["repinned"][0] == {
        "irq": 24,
        "actions": ["virtio24-input.0"],
        "from": "40-41",
        "to": "0-1,12-13,24-25,36-37",
    }
    assert (root / "proc/irq/24/smp_affinity_list").read_text() == "0-1,12-13,24-25,36-37"


def test_the_fleet_report_gets_a_drift_section(big, tmp_path, capsys):
    """verify.yml's per-host results (results/drift/<host>.json) in report.md/html/fleet.json."""
    from postcheck_results import host_result, write_results

    from rtfleet.report import build_report

    results = write_results(tmp_path / "results", [host_result("srv1"), host_result("srv2")])
    _sysctl_changed(big)
    big.put("proc/irq/9/smp_affinity_list", "%d\n" % big.plan["isolated"][5])
    assert big.run() == 1
    drifted = _result(capsys)
    (results / "drift").mkdir()
    (results / "drift/srv1.json").write_text(json.dumps({**drifted, "inventory_host": "srv1"}))
    (results / "drift/srv2.json").write_text("{truncated")
    fleet = build_report(results, tmp_path / "out", plots=False)
    assert [d["host"] for d in fleet["drift"]] == ["srv1", "srv2"]
    assert fleet["drift"][0]["drift"] and fleet["drift"][0]["repinned_irqs"] == 1
    assert "error" in fleet["drift"][1]
    assert fleet["verdict"]["passed"]  # drift is reported, the post-check verdict stands
    markdown = (tmp_path / "out/report.md").read_text()
    assert "## Drift" in markdown and "| srv1 | DRIFT |" in markdown
    assert "- sysctls (drift): vm.swappiness is 60, wanted 10" in markdown
    assert "- irqs (repaired): IRQ 9 (virtio9-input.0)" in markdown
    html = (tmp_path / "out/report.html").read_text()
    assert "<h2>Drift</h2>" in html and "vm.swappiness is 60, wanted 10" in html
    saved = json.loads((tmp_path / "out/fleet.json").read_text())
    assert saved["drift"][0]["checks"]["sysctls"]["status"] == "drift"


def test_a_host_without_the_runtime_role_skips_the_unit_checks(big, capsys):
    (big.root / "etc/systemd/system/shminfer@.service").unlink()
    (big.root / KUBELET).unlink()
    assert big.run("--textfile-dir", "/srv/textfiles") == 0
    statuses = _statuses(_result(capsys))
    assert statuses["units"] == statuses["unit_threads"] == statuses["kubelet"] == "skipped"
    assert (big.root / "srv/textfiles/rtfleet_drift.prom").exists()


@pytest.mark.parametrize("shape", ["xeon-2s-smt", "epyc-9354-2s-nps4-cxl"])
def test_units_check_reads_systemctls_cpusets_and_says_what_it_saw(trees, shape):
    # systemctl show prints a cpuset space-separated ("1-39 81-119"): an SMT host's group.
    plan = plan_partition(read_topology(str(trees(shape))))
    shown = {
        drift_units.unit_name(g): {
            "ActiveState": "active",
            "CPUAffinity": format_cpulist(g["cpus"]).replace(",", " "),
            "NUMAPolicy": "bind",
            "NUMAMask": str(g["memory_node"]),
        }
        for g in plan["runtime_groups"]
    }
    ok = drift_units.check_units(plan, shown, True)
    assert ok["status"] == "ok", ok["details"]
    first = drift_units.unit_name(plan["runtime_groups"][0])
    assert ok["units"][first]["cpu_affinity"] == shown[first]["CPUAffinity"]
    assert ok["units"][first]["problems"] == []
    # Output systemd would never print, read as drift of that unit only (never a crash).
    for junk in ("not-a-list", "0-", "\x00\x01", "99999999999"):
        shown[first]["CPUAffinity"] = junk
        bad = drift_units.check_units(plan, shown, True)
        assert bad["status"] == "drift"
        assert [u for u, seen in bad["units"].items() if seen["problems"]] == [first]
