"""The sampler workload for Kubernetes (roles/rtfleet_sampler: its sampler.yaml.j2 and
tasks; rtfleet.sampler; playbooks/samplers.yml; `rtfleet sampler-check`).

The manifest is rendered from plans of server trees (256-CPU EPYC with SMT, NPS4 with
CPU-less CXL nodes, a memoryless socket, the captured lab server) and validated offline
against Kubernetes' schemas (kubernetes-validate); then each rule is broken once and must
give exactly one line naming it. The playbook runs for real on localhost.
"""

from __future__ import annotations

import copy
import json
import sys
import tarfile
from pathlib import Path

import jinja2
import pytest
import yaml
from conftest import REPO, run_local_playbook

from rtfleet import cli
from rtfleet.plan_record import to_record
from rtfleet.planner import plan_partition
from rtfleet.sampler import (
    THREAD_ENV,
    SamplerError,
    check_manifest,
    check_manifest_text,
    podman_argv_text,
    sampler_classes,
    sampler_spec,
)
from rtfleet.topology import read_topology

BIG = ("epyc-7763-2s", "epyc-9354-2s-nps4-cxl", "xeon-2s-memoryless-node0")
LAB = REPO / "tests/fixtures/sysfs/lab-server-nps2.tar.gz"
LAB_POLICY = {
    "housekeeping_cores_per_node": 1,
    "runtime_l3_groups": "all",
    "partial_l3_groups": "pod_pool",
    "runtime_threads": "one_thread_per_core",
}
TEMPLATE = REPO / "roles/rtfleet_sampler/templates/sampler.yaml.j2"
GID, UID = 991, 992


@pytest.fixture(scope="module")
def plans(trees, tmp_path_factory):
    found = {}
    for shape in BIG:
        topology = read_topology(str(trees(shape)))
        policy = {"runtime_l3_groups": max(1, len(topology["l3_groups"]) // 2)}
        found[shape] = plan_partition(topology, policy)
    root = tmp_path_factory.mktemp("lab-server-nps2")
    with tarfile.open(LAB) as tar:
        tar.extractall(root, filter="data")
    found["lab-server-nps2"] = plan_partition(read_topology(str(root)), LAB_POLICY)
    return found


def _records(plan, hosts=("node-a", "node-b"), host_class="epyc", **overrides):
    return [
        {
            "host": host,
            "host_class": host_class,
            "node_name": host + ".example",
            "plan": plan,
            "gid": GID,
            "uid": UID,
            **overrides,
        }
        for host in hosts
    ]


def _with(records, **settings):
    """The records with every host's rtfleet_sampler_* settings."""
    return [{**r, "settings": {**r.get("settings", {}), **settings}} for r in records]


def _render(entry, kind="Job"):
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.from_string(TEMPLATE.read_text()).render(
        sampler={**entry["settings"], **entry, "kind": kind}
    )


@pytest.mark.parametrize("shape", [*BIG, "lab-server-nps2"])
@pytest.mark.parametrize("kind", ["Job", "Deployment"])
def test_the_manifest_of_every_server_shape_validates_and_keeps_every_rule(plans, shape, kind):
    plan = plans[shape]
    (entry,) = sampler_classes(
        _with(_records(plan), threads=1, replicas_per_unit=1, memory_mib=512)
    )
    text = _render(entry, kind)
    assert check_manifest_text(text, gid=GID) == []
    (doc,) = [d for d in yaml.safe_load_all(text) if d]
    pod = doc["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # Guaranteed with whole CPUs; one sampler per unit on each of the two hosts.
    units = len(plan["runtime_groups"])
    assert (doc["spec"].get("replicas") or doc["spec"]["completions"]) == 2 * units
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert container["resources"]["limits"]["cpu"] == "1"
    # The runtime's directory and nothing else of the host; its group; its user's uid.
    assert [v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v] == ["/run/shminfer"]
    assert pod["securityContext"]["supplementalGroups"] == [GID]
    assert "hostIPC" not in pod
    env = {e["name"]: e["value"] for e in container["env"]}
    assert {name: env[name] for name in THREAD_ENV} == dict.fromkeys(THREAD_ENV, "1")
    assert env["SHMINFER_SERVER_USERS"] == str(UID)
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == [
        "node-a.example",
        "node-b.example",
    ]


def _pod(doc):
    return doc["spec"]["template"]["spec"]


def _container(doc):
    return _pod(doc)["containers"][0]


def _drop_groups(doc):
    del _pod(doc)["securityContext"]["supplementalGroups"]


def _mount_dev_shm(doc):
    _pod(doc)["volumes"].append({"name": "shm", "hostPath": {"path": "/dev/shm"}})
    _container(doc)["volumeMounts"].append({"name": "shm", "mountPath": "/dev/shm"})


def _wrong_host_path(doc):
    _pod(doc)["volumes"][0]["hostPath"]["path"] = "/run"


def _no_host_path(doc):
    _pod(doc)["volumes"][0] = {"name": "shminfer", "emptyDir": {}}


def _wrong_mount_path(doc):
    _container(doc)["volumeMounts"][0]["mountPath"] = "/var/run/shminfer"


def _writable_mount(doc):
    _container(doc)["volumeMounts"][0]["readOnly"] = False


def _host_ipc(doc):
    _pod(doc)["hostIPC"] = True


def _milli_cpu(doc):
    for key in ("requests", "limits"):
        _container(doc)["resources"][key]["cpu"] = "1500m"


def _burstable_memory(doc):
    _container(doc)["resources"]["requests"]["memory"] = "256Mi"


def _added_capability(doc):
    _container(doc)["securityContext"]["capabilities"]["add"] = ["SYS_NICE"]


def _writable_root(doc):
    _container(doc)["securityContext"]["readOnlyRootFilesystem"] = False


def _wrong_threads(doc):
    for var in _container(doc)["env"]:
        if var["name"] == "OMP_NUM_THREADS":
            var["value"] = "8"


def _schema_break(doc):
    doc["spec"]["parallelism"] = "two"


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (_drop_groups, "securityContext.supplementalGroups [] lacks the runtime's group 991"),
        (_mount_dev_shm, "volume shm mounts the host's /dev/shm: a sampler mounts only"),
        (_wrong_host_path, "volume shminfer mounts the host's /run: a sampler mounts only"),
        (_no_host_path, "no volume mounts the host's /run/shminfer (hostPath)"),
        (_wrong_mount_path, "mounts /run/shminfer at /var/run/shminfer: mount it at"),
        (_writable_mount, "volumeMount shminfer of /run/shminfer must be readOnly: true"),
        (_host_ipc, "hostIPC: true shares the host's"),
        (_milli_cpu, "resources.limits.cpu 1500m is not a whole number of CPUs"),
        (_burstable_memory, "requests.memory 256Mi != limits.memory 512Mi (not Guaranteed)"),
        (_added_capability, "capabilities.add ['SYS_NICE']: a sampler needs none"),
        (_writable_root, "readOnlyRootFilesystem must be true"),
        (_wrong_threads, "OMP_NUM_THREADS must be 1 (its CPUs), not ['8']"),
        (_schema_break, "spec.parallelism: 'two' is not of type 'integer'"),
    ],
)
def test_each_broken_rule_is_one_line_that_names_it(plans, break_it, message):
    (entry,) = sampler_classes(
        _with(_records(plans["lab-server-nps2"]), threads=1, replicas_per_unit=1, memory_mib=512)
    )
    (doc,) = [d for d in yaml.safe_load_all(_render(entry)) if d]
    broken = copy.deepcopy(doc)
    break_it(broken)
    errors = check_manifest([broken], gid=GID)
    assert len(errors) == 1, errors
    assert errors[0].startswith("Job/rtfleet-sampler-epyc"), errors
    assert message in errors[0], errors
    assert "\n" not in errors[0]


def test_the_plan_decides_threads_room_and_ids(plans):
    plan = plans["epyc-7763-2s"]
    # More samplers than the pod pool near a unit holds: says which units and what to lower.
    with pytest.raises(SamplerError, match=r"share \d+ pod-pool CPUs, and 1 sampler\(s\) x 64"):
        sampler_spec(
            {r["host"]: r for r in _records(plan)}, threads=64, replicas_per_unit=1, memory_mib=512
        )
    roomy = sampler_spec(
        {r["host"]: r for r in _records(plan)}, threads=2, replicas_per_unit=2, memory_mib=512
    )
    assert roomy["replicas"] == 2 * 2 * len(plan["runtime_groups"])
    records = _records(plan)
    records[1]["gid"] = GID + 1
    with pytest.raises(SamplerError, match=r"gid differs between hosts .*node-a 991, node-b 992"):
        sampler_classes(_with(records, threads=1, replicas_per_unit=1, memory_mib=512))
    mixed = _records(plan) + _records(plans["lab-server-nps2"], hosts=("lab",))
    with pytest.raises(SamplerError, match="different numbers of units"):
        sampler_classes(_with(mixed, threads=1, replicas_per_unit=1, memory_mib=512))
    with pytest.raises(SamplerError, match="rtfleet_host_class 'EPYC_1' must be"):
        sampler_classes(
            _with(
                _records(plan, host_class="EPYC_1"), threads=1, replicas_per_unit=1, memory_mib=512
            )
        )
    with pytest.raises(SamplerError, match="rtfleet_sampler_threads must be an integer >= 1"):
        sampler_classes(_with(_records(plan), threads=0, replicas_per_unit=1, memory_mib=512))
    # Two classes, two manifests, sorted.
    two = _records(plan) + _records(plans["lab-server-nps2"], hosts=("lab",), host_class="lab")
    assert [
        c["host_class"]
        for c in sampler_classes(_with(two, threads=1, replicas_per_unit=1, memory_mib=512))
    ] == ["epyc", "lab"]


def test_sampler_check_reads_files_and_says_each_rule_broken(plans, tmp_path, capsys):
    (entry,) = sampler_classes(
        _with(_records(plans["lab-server-nps2"]), threads=1, replicas_per_unit=1, memory_mib=512)
    )
    good = tmp_path / "good.yaml"
    good.write_text(_render(entry))
    assert cli.main(["sampler-check", "--gid", str(GID), str(good)]) == 0
    assert capsys.readouterr().out == ""
    (doc,) = [d for d in yaml.safe_load_all(good.read_text()) if d]
    _drop_groups(doc)
    _mount_dev_shm(doc)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    assert cli.main(["sampler-check", "--gid", str(GID), str(bad)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(line.startswith(f"{bad}: Job/") for line in lines)
    (tmp_path / "junk.yaml").write_text("kind: [unclosed\n")
    assert cli.main(["sampler-check", "--gid", "1", str(tmp_path / "junk.yaml")]) == 1
    assert "not YAML" in capsys.readouterr().out
    assert cli.main(["sampler-check", "--gid", "1", str(tmp_path / "absent.yaml")]) == 2
    assert "absent.yaml: No such file" in capsys.readouterr().err


def test_the_samplers_playbook_writes_a_checked_manifest_from_the_plan_record(plans, tmp_path):
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(to_record(plans["lab-server-nps2"])))
    out = tmp_path / "manifests"
    common = [
        "-e",
        f"rtfleet_host_plan_file={plan_file}",
        "-e",
        f"rtfleet_sampler_manifest_dir={out}",
        "-e",
        "rtfleet_runtime_group=root rtfleet_runtime_user=root rtfleet_host_class=lab",
    ]
    run = run_local_playbook(REPO / "playbooks/samplers.yml", *common)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    text = (out / "sampler-lab.yaml").read_text()
    assert check_manifest_text(text, gid=0) == []
    (doc,) = [d for d in yaml.safe_load_all(text) if d]
    assert doc["spec"]["completions"] == len(plans["lab-server-nps2"]["runtime_groups"])
    # Too many threads: the play stops with the one line that says what to lower, and no
    # manifest is written.
    run = run_local_playbook(
        REPO / "playbooks/samplers.yml",
        *common,
        "-e",
        f"rtfleet_sampler_manifest_dir={tmp_path / 'none'}",
        "-e",
        "rtfleet_sampler_threads=40",
    )
    assert run.returncode != 0
    assert "lower rtfleet_sampler_threads or rtfleet_sampler_replicas_per_unit" in run.stdout
    assert not (tmp_path / "none" / "sampler-lab.yaml").exists()


def test_podman_runs_one_replica_with_exactly_the_manifests_settings(plans):
    """The argv the lab runs for a pod (no kubelet here): the manifest's user, group,
    read-only mount, environment, limits and read-only root, on the whole CPUs and the
    memory node a kubelet's CPU and Memory Managers would give it."""
    (entry,) = sampler_classes(
        _with(_records(plans["lab-server-nps2"]), threads=2, replicas_per_unit=1, memory_mib=512)
    )
    text = _render(entry)
    argv = podman_argv_text(text, cpus=[3, 2], mems=[0], image="localhost/s:1")
    assert argv[:3] == ["podman", "run", "--rm"]
    for flag in (
        "--network=none",
        "--ipc=private",
        "--cpuset-cpus=2,3",
        "--cpuset-mems=0",
        "--user=65534:65534",
        f"--group-add={GID}",
        f"--memory={512 << 20}",
        "--read-only",
        "--security-opt=no-new-privileges",
        "--cap-drop=all",
        "--volume=/run/shminfer:/run/shminfer:ro",
        f"--tmpfs=/tmp:rw,size={64 << 20},mode=1777",
        '--entrypoint=["shminfer", "smoke", "--requests", "2000"]',
    ):
        assert flag in argv, (flag, argv)
    env = [argv[i + 1] for i, a in enumerate(argv) if a == "--env"]
    assert "OMP_NUM_THREADS=2" in env and f"SHMINFER_SERVER_USERS={UID}" in env
    assert argv[-1] == "localhost/s:1"
    with pytest.raises(SamplerError, match="CPU limit 2 is not 3 CPUs"):
        podman_argv_text(text, cpus=[1, 2, 3], mems=[0])
    with pytest.raises(SamplerError, match="no workload with a pod template"):
        podman_argv_text("kind: ConfigMap\n", cpus=[1], mems=[0])


def test_a_class_without_a_pod_pool_gets_no_manifest(trees):
    """The 8-vCPU lab EPYC guest's plan gives every CPU to housekeeping or the runtime."""
    root = REPO / "tests/fixtures/sysfs/lab-epyc-2ccx.tar.gz"
    with tarfile.open(root) as tar:
        target = Path(trees("epyc-7763-2s")).parent / "lab-epyc-2ccx"
        tar.extractall(target, filter="data")
    plan = plan_partition(read_topology(str(target)), {"runtime_l3_groups": "all"})
    assert plan["pod_pool"] == []
    (entry,) = sampler_classes(
        _with(_records(plan), threads=1, replicas_per_unit=1, memory_mib=512)
    )
    assert entry["host_class"] == "epyc" and "no pod-pool CPU" in entry["skipped"]


def test_every_host_of_a_class_must_agree_on_its_samplers(plans):
    """One manifest serves a class: its hosts' rtfleet_sampler_* must agree, and bad ones
    are one line naming the variable."""
    records = _with(_records(plans["lab-server-nps2"]), threads=2)
    records[1]["settings"]["threads"] = 1
    with pytest.raises(
        SamplerError, match=r"node-a and node-b disagree on rtfleet_sampler_threads \(2, 1\)"
    ):
        sampler_classes(records)
    (entry,) = sampler_classes(
        _with(_records(plans["lab-server-nps2"]), threads="2", kind="Deployment")
    )
    assert entry["spec"]["threads"] == 2 and entry["settings"]["kind"] == "Deployment"
    for key, value, message in (
        ("kind", "CronJob", "rtfleet_sampler_kind must be one of"),
        ("uid", 0, "rtfleet_sampler_uid must be a user id >= 1"),
        ("command", "shminfer smoke", "rtfleet_sampler_command must be a list of strings"),
    ):
        with pytest.raises(SamplerError, match=message):
            sampler_classes(_with(_records(plans["lab-server-nps2"]), **{key: value}))


def test_the_runtime_contract_matches_shminfers():
    """rtfleet.sampler carries shminfer's run directory and thread variables (shminfer is
    its own distribution, which the collection does not import); they must stay equal."""
    from rtfleet import sampler
    from shminfer.registry import DEFAULT_DIR
    from shminfer.server import THREAD_ENV

    assert sampler.RUN_DIR == DEFAULT_DIR
    assert sampler.THREAD_ENV == THREAD_ENV


def test_the_samplers_playbook_writes_the_manifest_under_limit(plans, tmp_path):
    """`-l rack1` leaves localhost out of every play; the manifest play runs once on the
    controller for the limited hosts (it was skipped: no manifest, and the container play
    after it failed on the class figures it never set)."""
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(to_record(plans["lab-server-nps2"])))
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(json.dumps({"rack1": {"hosts": {"n1": local, "n2": local}}}))
    out = tmp_path / "manifests"
    run = run_local_playbook(
        REPO / "playbooks/samplers.yml",
        "-i", str(inventory),
        "--limit", "rack1",
        "-e", f"rtfleet_host_plan_file={plan_file}",
        "-e", f"rtfleet_sampler_manifest_dir={out}",
        "-e", "rtfleet_runtime_group=root rtfleet_runtime_user=root rtfleet_host_class=lab",
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "no hosts matched" not in run.stdout
    assert check_manifest_text((out / "sampler-lab.yaml").read_text(), gid=0) == []
    assert run.stdout.count("rtfleet_sampler : Write it]") == 1, run.stdout[-3000:]
