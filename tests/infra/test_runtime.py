"""After rollout: one healthy shminfer unit per runtime group, pinned and NUMA-bound as planned.

Read back from the running processes, not from the unit files: the drift guard's checks
(rtfleet-drift --check, the one checker of a host against its plan) find each unit pinned
and bound as planned and every thread of its cgroup on its group's CPUs; each worker runs
on exactly one of them (/proc/PID/status Cpus_allowed_list); its memory policy is bind to
the group's node and its own memory (heap, stacks, its queues in /dev/shm) sits on that
node (/proc/PID/numa_maps); and it holds no capability and runs sandboxed (Type=notify
with a watchdog, private /dev, a system call filter) in rtfleet.slice, confined to its
group's CPUs.
Each unit answers `shminfer probe`. Run with --sudo (numa_maps of another user's process).
"""

from __future__ import annotations

import json
import re

import pytest
from rtfleet_infra import drift_guard, read_files

from ansible_collections.rtfleet.fleet.plugins.module_utils.cpulist import parse_cpulist

SHMINFER = "/opt/shminfer/current/venv/bin/shminfer"
MODELS = "/opt/shminfer/current/models"
# \036 starts a process, \037 separates its status from its numa_maps.
_PROCS = (
    "cg=$(systemctl show --property=ControlGroup --value %s); "
    'for pid in $(cat "/sys/fs/cgroup${cg}/cgroup.procs"); do '
    "printf '\\036%%s\\037' $pid; cat /proc/$pid/status; printf '\\037'; "
    "cat /proc/$pid/numa_maps; done"
)


def _groups(plan):
    groups = plan.get("runtime_groups") or []
    if not groups:
        pytest.fail("the plan has no runtime group: rtfleet_runtime has nothing to run")
    return groups


def _processes(host, unit):
    """[{pid, status: {field: value}, numa_maps: [lines]}] for every process of the unit."""
    out = host.run(_PROCS % unit).stdout
    procs = []
    for chunk in out.split("\036")[1:]:
        pid, status, maps = [*chunk.split("\037"), "", ""][:3]
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        procs.append(
            {"pid": int(pid), "status": fields, "numa_maps": [m for m in maps.splitlines() if m]}
        )
    return procs


def test_one_active_enabled_unit_per_runtime_group(host, rtfleet_plan):
    wanted = {"shminfer@%s.service" % g["name"] for g in _groups(rtfleet_plan)}
    for unit in sorted(wanted):
        service = host.service(unit)
        assert service.is_running, "%s is not running" % unit
        assert service.is_enabled, "%s is not enabled" % unit
    listed = host.run(
        "systemctl list-units --all --plain --no-legend --state=active 'shminfer@*'"
    ).stdout.split()
    extra = {u for u in listed if u.startswith("shminfer@")} - wanted
    assert not extra, "units not in the plan are still active: %s" % sorted(extra)


def test_units_and_every_thread_are_where_the_plan_says(host, rtfleet_plan):
    # The drift guard's checks, the one checker of a host against its plan (the post-check's
    # consistency lines are its words): each unit active with the group's CPUAffinity and
    # its memory bound to the group's node, and every thread of every process in its cgroup
    # allowed only on, and last run on, the group's CPUs.
    _groups(rtfleet_plan)
    _rc, result, log, _ = drift_guard(host, "--check")
    for name in ("units", "unit_threads"):
        check = result["checks"][name]
        assert check["status"] == "ok", "%s: %s %s" % (name, check["details"], log)


def test_every_worker_cpu_has_a_process_pinned_to_it_alone(host, rtfleet_plan):
    for group in _groups(rtfleet_plan):
        unit = "shminfer@%s.service" % group["name"]
        procs = _processes(host, unit)
        assert procs, "%s has no processes" % unit
        allowed = [set(parse_cpulist(p["status"]["Cpus_allowed_list"])) for p in procs]
        # shminfer pins one worker per CPU: every worker CPU has a process pinned to it alone.
        pinned = {min(cpus) for cpus in allowed if len(cpus) == 1}
        assert pinned >= set(group["worker_cpus"]), "%s: workers pinned to %s, plan %s" % (
            unit,
            sorted(pinned),
            group["worker_cpus"],
        )


def test_unit_memory_is_bound_to_its_node(host, rtfleet_plan):
    for group in _groups(rtfleet_plan):
        unit = "shminfer@%s.service" % group["name"]
        # A memoryless node's group binds to the nearest node with memory (the plan says which).
        node = group.get("memory_node", group["numa_node"])
        for proc in _processes(host, unit):
            # Mappings that hold pages; a library may give an empty reservation its own policy.
            policies = {m.split()[1] for m in proc["numa_maps"] if re.search(r" N\d+=", m)}
            assert policies == {"bind:%d" % node}, "%s pid %d: memory policies %s, plan bind:%d" % (
                unit,
                proc["pid"],
                sorted(policies),
                node,
            )
            # Memory the process allocated itself: anonymous mappings (heap, stacks, arenas)
            # and its own queues (sealed memfds). Shared libraries' page cache may have been
            # read in by another unit, on another node, first.
            own = ("file=/memfd:shminfer.%s." % group["name"],)
            elsewhere = {
                n
                for m in proc["numa_maps"]
                if "file=" not in m or any(o in m for o in own)
                for n in re.findall(r" N(\d+)=", m)
                if int(n) != node
            }
            assert not elsewhere, "%s pid %d: own memory on nodes %s, plan %d" % (
                unit,
                proc["pid"],
                sorted(elsewhere),
                node,
            )


def test_unit_holds_no_capability(host, rtfleet_plan):
    # SCHED_FIFO comes from LimitRTPRIO= alone; CAP_SYS_NICE would let a compromised worker
    # re-prioritise any process on the host.
    for group in _groups(rtfleet_plan):
        unit = "shminfer@%s.service" % group["name"]
        for proc in _processes(host, unit):
            status = proc["status"]
            assert int(status["CapEff"], 16) == 0, "%s pid %d CapEff %s" % (
                unit,
                proc["pid"],
                status["CapEff"],
            )
            assert int(status["CapBnd"], 16) == 0
            assert status["NoNewPrivs"].strip() == "1"
            assert status["Uid"].split()[0] != "0", "%s runs as root" % unit


_HARDENING = (
    "Type,WatchdogUSec,PrivateDevices,ProcSubset,ProtectProc,SystemCallFilter,"
    "IPAddressDeny,MemoryMax,TasksMax,Slice,AllowedCPUs,ControlGroup"
)


def test_unit_is_sandboxed_and_confined_to_its_group(host, rtfleet_plan):
    for group in _groups(rtfleet_plan):
        unit = "shminfer@%s.service" % group["name"]
        out = host.run("systemctl show --property=%s %s", _HARDENING, unit).stdout
        shown = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        assert shown["Type"] == "notify" and shown["WatchdogUSec"] not in ("0", "infinity")
        assert shown["PrivateDevices"] == "yes" and shown["ProcSubset"] == "pid"
        assert shown["ProtectProc"] == "invisible"
        assert shown["SystemCallFilter"], "%s has no system call filter" % unit
        assert shown["MemoryMax"] != "infinity" and shown["TasksMax"] != "infinity"
        assert shown["Slice"] == "rtfleet.slice"
        assert parse_cpulist(shown["AllowedCPUs"].replace(" ", ",")) == group["cpus"]
        # The cgroup's effective cpuset is the group's CPUs, whatever a thread asks for.
        effective = read_files(
            host, "/sys/fs/cgroup%s/cpuset.cpus.effective" % shown["ControlGroup"]
        )
        assert parse_cpulist(next(iter(effective.values())).strip()) == group["cpus"]


def test_units_answer_their_probe(host, rtfleet_plan):
    for group in _groups(rtfleet_plan):
        probe = host.run("%s probe --name %s --ready-timeout 60", SHMINFER, group["name"])
        assert probe.rc == 0, "shminfer@%s probe: %s" % (group["name"], probe.stderr)
        answer = json.loads(probe.stdout)
        assert answer["ready"] and answer["worker_cpus"] == group["worker_cpus"]


def test_each_unit_publishes_in_its_own_directory_and_nothing_in_dev_shm(host, rtfleet_plan):
    """What a pod mounts (/run/shminfer, read-only) holds one directory per unit, the
    service user's (nobody else can plant or swap a file), group shminfer; the registry
    and the socket are the group's; the queues are memfds, so /dev/shm has nothing."""
    for group in _groups(rtfleet_plan):
        path = "/run/shminfer/%s" % group["name"]
        unit_dir = host.file(path)
        assert unit_dir.is_directory and not unit_dir.is_symlink, path
        assert (unit_dir.user, unit_dir.group, unit_dir.mode) == ("shminfer", "shminfer", 0o751)
        registry = host.file(path + "/registry.json")
        assert (registry.user, registry.group, registry.mode) == ("shminfer", "shminfer", 0o640)
        sock = host.file(path + "/server.sock")
        assert sock.is_socket and (sock.user, sock.group, sock.mode) == (
            "shminfer",
            "shminfer",
            0o660,
        )
    assert host.file("/run/shminfer").mode == 0o755
    leftovers = host.run("find /dev/shm -maxdepth 1 -name 'shminfer*'").stdout.split()
    assert not leftovers, "shminfer files in /dev/shm: %s" % leftovers


def test_samplers_find_a_unit_on_their_own_node(host, rtfleet_plan):
    """`shminfer where`, asked for the first CPU the plan gives each unit's samplers on the
    unit's own node, names a running unit on that node (Client.nearest() takes the same)."""
    node_of = {g["name"]: g["numa_node"] for g in _groups(rtfleet_plan)}
    for group in _groups(rtfleet_plan):
        if not str(group.get("sampler_cpus_from", "")).endswith("_same_node"):
            continue  # samplers placed off the unit's node: another unit may be nearer
        cpu = group["sampler_cpus"][0]
        run = host.run("%s where --cpus %s --format json", SHMINFER, str(cpu))
        assert run.rc == 0, "shminfer where --cpus %s: %s" % (cpu, run.stderr)
        answer = json.loads(run.stdout)
        assert answer["local"], answer["reason"]
        assert node_of.get(answer["unit"]) == group["numa_node"], answer["reason"]


def test_model_files_match_their_checksums(host):
    files = read_files(host, MODELS + "/SHA256SUMS")
    assert files[MODELS + "/SHA256SUMS"], "no %s/SHA256SUMS" % MODELS
    check = host.run("cd %s && sha256sum --check --strict SHA256SUMS", MODELS)
    assert check.rc == 0, check.stdout + check.stderr


PREFIX = "/opt/shminfer"


def test_every_unit_runs_the_verified_release_current_points_at(host, rtfleet_plan):
    """The release switch (rtfleet_runtime README, "The release switch"): `current` is a
    complete release, nothing is left unverified, at most two releases are kept, and every
    unit's process runs the venv of the release `current` points at (its command line starts
    with the interpreter pip wrote into the release's scripts)."""
    current = host.file(PREFIX + "/current")
    assert current.is_symlink, "%s is not a link" % current.path
    release = current.linked_to.rsplit("/", 1)[-1]
    assert re.fullmatch(r"[0-9a-f]{16}", release), current.linked_to
    complete = read_files(host, "%s/releases/%s/.complete" % (PREFIX, release))
    assert complete[f"{PREFIX}/releases/{release}/.complete"].strip().startswith(release)
    assert not host.file(PREFIX + "/.verifying").exists, "the release never answered on every unit"
    kept = host.run("ls -1 %s/releases", PREFIX).stdout.split()
    assert release in kept and len(kept) <= 2, kept
    for group in _groups(rtfleet_plan):
        unit = "shminfer@%s.service" % group["name"]
        pid = host.run("systemctl show --property=MainPID --value %s", unit).stdout.strip()
        argv = host.run("tr '\\0' ' ' < /proc/%s/cmdline", pid).stdout.split()
        assert argv and "/releases/%s/venv/" % release in argv[0], (unit, argv)


TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"


def test_unit_metrics_reach_node_exporters_textfile_directory(host, rtfleet_plan):
    """Each unit's metrics file is linked from node_exporter's textfile directory, fresh
    (rewritten every 15 s), readable by any user and valid for Prometheus' own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    for group in _groups(rtfleet_plan):
        name = group["name"]
        link = host.file("%s/shminfer_%s.prom" % (TEXTFILE_DIR, name))
        assert link.is_symlink, "%s is not a link" % link.path
        assert link.linked_to == "/run/shminfer/%s/metrics.prom" % name
        age = host.run("echo $(( $(date +%%s) - $(stat -L -c %%Y %s) ))" % link.path).stdout.strip()
        assert age.isdigit() and int(age) <= 60, "%s is %s s old" % (link.path, age)
        assert host.file("/run/shminfer/%s/metrics.prom" % name).mode & 0o004
        samples = {
            sample.name: sample.value
            for family in text_string_to_metric_families(link.content_string)
            for sample in family.samples
            if sample.labels.get("server") == name and "quantile" not in sample.labels
        }
        workers = len(group.get("worker_cpus") or group["cpus"])
        assert samples["shminfer_workers"] == workers
        assert samples["shminfer_workers_ready"] == workers
