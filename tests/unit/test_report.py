"""The fleet report: files, plots, tables, before/after, verdict and CLI exit codes."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import REPO, run_local_playbook
from postcheck_results import host_result, smoke_entry, write_results

from rtfleet import cli
from rtfleet.report import build_report
from rtfleet.report_files import ReportError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _fleet(tmp_path, *, baseline=True, failing=False):
    """Two tuned hosts (one failing when asked) and optionally one baseline VM."""
    epyc2_smoke = [smoke_entry("resnet"), smoke_entry("bert", deschedule_ms=0.2)]
    if failing:
        epyc2_smoke[1] = smoke_entry(
            "bert", deschedule_ms=0.2, failures=["latency p99 7.100 ms > 5.0 ms"]
        )
    results = [
        host_result("epyc1"),
        host_result("epyc2", cyclictest="hist200-overflow", smoke=epyc2_smoke),
    ]
    if baseline:
        results.append(
            host_result(
                "vm1",
                kind="baseline",
                cyclictest="hist200-histfile",
                hwlatdetect=None,
                oslat=None,
                smoke=[
                    smoke_entry(
                        "resnet",
                        latency_ms=(2.0, 9.0, 20.0, 40.0),
                        deschedule_ms=1.5,
                        thread_share=0.5,
                    )
                ],
            )
        )
    return write_results(tmp_path / "results", results)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One full report (with a baseline), built once: plotting is the slow part."""
    base = tmp_path_factory.mktemp("report")
    out = base / "out"
    fleet = build_report(_fleet(base, failing=True), out)
    return fleet, out


def test_report_writes_every_file(report):
    fleet, out = report
    for name in ("fleet.json", "report.md", "report.html"):
        assert (out / name).stat().st_size > 0
    plots = sorted(p.name for p in (out / "plots").iterdir())
    assert plots == sorted(
        [
            "epyc1-cpu-max.png",
            "epyc1-latency-histogram.png",
            "epyc1-oslat-cpu-max.png",
            "epyc1-oslat-histogram.png",
            "epyc1-smoke-latency.png",
            "epyc2-cpu-max.png",
            "epyc2-latency-histogram.png",
            "epyc2-oslat-cpu-max.png",
            "epyc2-oslat-histogram.png",
            "epyc2-smoke-latency.png",
            "vm1-baseline-cpu-max.png",
            "vm1-baseline-latency-histogram.png",
            "vm1-baseline-smoke-latency.png",
        ]
    )
    assert sorted(p.split("/")[1] for p in fleet["files"]["plots"]) == plots
    for name in plots:
        width, height = _png_size(out / "plots" / name)
        assert width >= 400 and height >= 300


def test_fleet_json_has_hosts_verdict_and_parsed_cyclictest(report):
    _, out = report
    fleet = json.loads((out / "fleet.json").read_text())
    assert [(h["host"], h["kind"]) for h in fleet["hosts"]] == [
        ("epyc1", "tuned"),
        ("epyc2", "tuned"),
        ("vm1", "baseline"),
    ]
    assert fleet["verdict"] == {
        "passed": False,
        "reason": "1 of 2 tuned host(s) failed: epyc2",
        "tuned": 2,
        "baseline": 1,
        "failed_hosts": ["epyc2"],
    }
    epyc2 = fleet["hosts"][1]
    assert epyc2["gate"]["failures"] == ["smoke bert: latency p99 7.100 ms > 5.0 ms"]
    summary = epyc2["cyclictest"]["summary"]
    assert summary["max_us"] == 2906 and summary["p999_beyond_histogram"]
    assert "json" not in epyc2["cyclictest"]  # parsed, not the raw document again
    assert epyc2["plots"]["cpu_max"] == "plots/epyc2-cpu-max.png"


def test_html_is_self_contained_with_the_tables(report):
    _, out = report
    page = (out / "report.html").read_text()
    for table in ("fleet", "before-after", "cpus", "smoke", "consistency"):
        assert f'<table class="{table}">' in page
    assert "<td>epyc2</td><td>tuned</td><td>6.18.44-fc-v782</td><td>2906</td><td>≥ 200</td>" in page
    assert '<span class="fail">FAIL</span>' in page
    assert '<img src="plots/epyc1-latency-histogram.png"' in page
    assert "smoke bert: latency p99 7.100 ms &gt; 5.0 ms" in page
    lowered = page.lower()
    assert "<script" not in lowered and "<link" not in lowered and "http" not in lowered


def test_markdown_has_tables_failures_and_images(report):
    _, out = report
    text = (out / "report.md").read_text()
    assert "**Fleet: FAILED** (1 of 2 tuned host(s) failed: epyc2)" in text
    assert "| epyc1 | tuned | 6.18.44-fc-v782 | 2218 | 1170 | 1/1 passed | PASS |" in text
    assert "| 0 | 0 | 3000 | 6 | 28.75 | 876 | 114 | ≥ 200 | 16 |" in text  # epyc2 CPU 0
    assert "  - smoke bert: latency p99 7.100 ms > 5.0 ms" in text
    assert "![epyc2 cyclictest max latency per CPU](plots/epyc2-cpu-max.png)" in text
    # the trio: hwlatdetect first (here recorded as skipped), oslat after cyclictest
    assert text.index("### hwlatdetect") < text.index("### cyclictest") < text.index("### oslat")
    assert "Not run: the running kernel has no hwlat tracer (test)." in text
    assert "| 1 | 7927015 | 1 | 1.302 | 354113 | 1 | 1 | 373 |" in text  # oslat CPU 1
    assert "![epyc2 oslat histogram](plots/epyc2-oslat-histogram.png)" in text


def test_before_after_rows_take_the_worst_host_of_each_kind(report):
    fleet, out = report
    rows = {r["metric"]: r for r in fleet["before_after"]}
    ct_max = rows["cyclictest max"]
    assert ct_max["baseline"] == {"value": 2850, "beyond": False, "host": "vm1"}
    assert ct_max["tuned"] == {"value": 2906, "beyond": False, "host": "epyc2"}
    assert ct_max["ratio"] == pytest.approx(2906 / 2850)
    # The baseline's p99.9 is only a bound (>= 200 us): no ratio from a bound.
    p999 = rows["cyclictest p99.9"]
    assert p999["baseline"]["beyond"] and p999["baseline"]["value"] == 200
    assert p999["tuned"] == {"value": 1170, "beyond": False, "host": "epyc1"}
    assert p999["ratio"] is None
    assert rows["smoke round trip p99"]["ratio"] == pytest.approx(0.9 / 9.0)
    assert rows["deschedule p99.9"]["tuned"]["host"] == "epyc2"
    assert rows["deschedule p99.9"]["baseline"]["value"] == pytest.approx(1.5)
    assert rows["process/thread CPU ratio"]["baseline"]["value"] == pytest.approx(2.0)
    text = (out / "report.md").read_text()
    assert "| smoke round trip p99 (ms) | 9.000 (vm1) | 0.900 (epyc1) | 0.1 |" in text
    assert "| cyclictest p99.9 (µs) | ≥ 200 (vm1) | 1170 (epyc1) | n/a |" in text


def test_no_before_after_without_a_baseline(tmp_path):
    fleet = build_report(_fleet(tmp_path, baseline=False), tmp_path / "out", plots=False)
    assert fleet["before_after"] is None
    assert fleet["verdict"]["passed"]
    assert "Before and after" not in (tmp_path / "out" / "report.md").read_text()
    page = (tmp_path / "out" / "report.html").read_text()
    assert "Before and after" not in page and 'class="before-after"' not in page
    assert not (tmp_path / "out" / "plots").exists()


def test_only_baselines_is_not_a_passing_fleet(tmp_path):
    results = write_results(tmp_path / "r", [host_result("vm1", kind="baseline")])
    fleet = build_report(results, tmp_path / "out", plots=False)
    assert not fleet["verdict"]["passed"]
    assert fleet["verdict"]["reason"].startswith("no tuned host")
    assert fleet["before_after"] is None


def test_baseline_results_from_a_second_directory(tmp_path):
    tuned = write_results(tmp_path / "tuned", [host_result("epyc1")])
    baseline = write_results(tmp_path / "before", [host_result("vm1", kind="baseline")])
    fleet = build_report([tuned, baseline], tmp_path / "out", plots=False)
    assert [h["host"] for h in fleet["hosts"]] == ["epyc1", "vm1"]
    assert fleet["before_after"] is not None


def test_edited_gate_in_a_result_file_is_flagged(tmp_path):
    result = host_result("epyc1", cyclictest="hist200-overflow")
    result["gate"] = {"passed": True, "failures": []}
    result["thresholds"] = {"cyclictest_max_us": 100}
    fleet = build_report(write_results(tmp_path / "r", [result]), tmp_path / "out", plots=False)
    host = fleet["hosts"][0]
    assert not host["gate"]["passed"] and host["gate_recorded_differs"]
    assert "differs from this evaluation" in (tmp_path / "out" / "report.md").read_text()


def test_rerun_into_the_results_directory_skips_its_own_fleet_json(tmp_path):
    results = write_results(tmp_path / "r", [host_result("epyc1")])
    build_report(results, results, plots=False)
    fleet = build_report(results, results, plots=False)
    assert [h["host"] for h in fleet["hosts"]] == ["epyc1"]


def test_missing_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    results = write_results(tmp_path / "r", [host_result("epyc1")])
    with pytest.raises(ReportError, match=r"pip install 'rtfleet\[report\]'.*make setup"):
        build_report(results, tmp_path / "out")


# --------------------------------------------------------------------------- CLI


def test_cli_exit_0_when_every_tuned_host_passed(tmp_path, capsys):
    results = write_results(tmp_path / "r", [host_result("epyc1")])
    code = cli.main(["report", "--results", str(results), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 0
    assert "epyc1" in out and "PASS" in out and "fleet PASSED" in out
    assert f"report: {tmp_path / 'out' / 'report.html'}" in out
    assert (tmp_path / "out" / "plots" / "epyc1-cpu-max.png").is_file()


def test_cli_exit_1_when_a_host_failed_and_json_lists_why(tmp_path, capsys):
    results = _fleet(tmp_path, baseline=False, failing=True)
    argv = ["report", "--results", str(results), "--out", str(tmp_path / "out")]
    code = cli.main([*argv, "--format", "json"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 1
    assert summary["passed"] is False
    assert summary["verdict"]["failed_hosts"] == ["epyc2"]
    epyc2 = next(h for h in summary["hosts"] if h["host"] == "epyc2")
    assert epyc2["verdict"] == "FAIL"
    assert epyc2["failures"] == ["smoke bert: latency p99 7.100 ms > 5.0 ms"]
    assert summary["files"]["html"] == str(tmp_path / "out" / "report.html")


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: d.mkdir(), "no post-check results (*.json)"),
        (lambda d: None, "not a directory of post-check results"),
        (
            lambda d: (d.mkdir(), (d / "epyc1.json").write_text("{not json")),
            "epyc1.json: not valid JSON",
        ),
        (
            lambda d: (d.mkdir(), (d / "epyc1.json").write_text('{"schema": 1, "host": "x"}')),
            "'kind' is None",
        ),
        (
            lambda d: (
                write_results(d, [host_result("epyc1")])
                and (d / "copy.json").write_text(json.dumps(host_result("epyc1")))
            ),
            "both hold the tuned result of epyc1",
        ),
    ],
)
def test_cli_exit_2_on_bad_input(tmp_path, capsys, setup, message):
    results = tmp_path / "r"
    setup(results)
    code = cli.main(["report", "--results", str(results), "--out", str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("rtfleet: error: ") and message in err


@pytest.mark.parametrize("how", ["env", "extra-var"])
def test_report_playbook_writes_below_the_one_report_dir(tmp_path, how):
    """playbooks/report.yml (the postcheck role's `report` entry point) reads
    <dir>/results and writes the report into <dir>, for $RTFLEET_REPORT_DIR and for
    rtfleet_report_dir alike; a failed host's gate does not fail the step."""
    write_results(
        tmp_path / "results",
        [
            host_result("epyc1"),
            host_result(
                "epyc2", smoke=[smoke_entry("bert", failures=["latency p99 7.1 ms > 5.0 ms"])]
            ),
        ],
    )
    env = {"RTFLEET_REPORT_DIR": str(tmp_path)} if how == "env" else {}
    extra = ["-e", f"rtfleet_report_dir={tmp_path}"] if how == "extra-var" else []
    run = run_local_playbook(REPO / "playbooks" / "report.yml", *extra, **env)
    assert run.returncode == 0, run.stdout + run.stderr
    fleet = json.loads((tmp_path / "fleet.json").read_text())
    assert not fleet["verdict"]["passed"]
    assert (tmp_path / "report.html").exists()
    assert "epyc2" in run.stdout


def test_concurrent_writers_leave_one_complete_report(tmp_path):
    """Several failing hosts of a batch write the report at once (the rollout's rescue path):
    every file stays whole and fleet.json, report.md and the plots come from one run."""
    import subprocess

    results = _fleet(tmp_path)
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "rtfleet.cli", "report", "--results", str(results)]
    procs = [
        subprocess.Popen([*argv, "--out", str(out)], stdout=subprocess.DEVNULL) for _ in range(4)
    ]
    # A reader (the operator's browser, the next playbook) never sees half a file.
    partial = []
    while any(p.poll() is None for p in procs):
        for name in ("fleet.json", "report.html"):
            try:
                text = (out / name).read_text()
            except FileNotFoundError:
                continue
            if not (text.endswith("}\n") if name.endswith("json") else "</html>" in text):
                partial.append((name, len(text)))
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0, 0]
    assert partial == []
    fleet = json.loads((out / "fleet.json").read_text())
    assert sorted(h["host"] for h in fleet["hosts"]) == ["epyc1", "epyc2", "vm1"]
    for rel in fleet["files"]["plots"]:
        _png_size(out / rel)
    assert (out / "report.html").read_text().rstrip().endswith("</html>")
    leftovers = [p.name for p in out.rglob(".*") if p.name != ".report.lock"]
    assert leftovers == []


def test_rescue_path_writes_the_report_once_per_batch():
    """The rollout's rescue builds the report on the controller once, not once per host."""
    import yaml

    play = yaml.safe_load((REPO / "playbooks/rollout.yml").read_text())[-1]
    rescue = next(t for t in play["tasks"] if t["name"] == "Migrate this host")["rescue"]
    report = next(
        t for t in rescue if t.get("ansible.builtin.include_role", {}).get("tasks_from") == "report"
    )
    assert report.get("run_once") is True


def test_smoke_table_says_where_the_client_ran(tmp_path):
    pinned = dict(
        smoke_entry("ccx1"), client_cpu=2, client_cpu_from="pod_pool_same_node", client_cpus="2"
    )
    results = write_results(tmp_path / "r", [host_result("srv", smoke=[pinned, smoke_entry("b")])])
    build_report(results, tmp_path / "out", plots=False)
    markdown = (tmp_path / "out/report.md").read_text()
    assert "| ccx1 | 2 (pod pool, same node) |" in markdown
    assert "| b | not pinned |" in markdown


def test_an_emulated_host_says_its_figures_mean_nothing_about_hardware(tmp_path):
    result = host_result("lab1")
    result["virtualization"] = "qemu"
    vm = host_result("vm2")
    vm["virtualization"] = "vmware"
    bare = host_result("metal1")
    bare["virtualization"] = "none"
    write_results(tmp_path / "results", [result, vm, bare])
    build_report(tmp_path / "results", tmp_path / "out", plots=False)
    text = (tmp_path / "out" / "report.md").read_text()
    lab = text[text.index("## lab1") : text.index("## metal1")]
    assert "EMULATED CPU (QEMU TCG" in lab and "says nothing about hardware" in lab
    metal = text[text.index("## metal1") : text.index("## vm2")]
    assert "EMULATED" not in metal and "Virtual machine" not in metal
    assert "Virtual machine (vmware): hwlatdetect measures the hypervisor's stalls" in text
    assert "EMULATED CPU (QEMU TCG" in (tmp_path / "out" / "report.html").read_text()


def test_refused_hosts_show_their_deception_verdict_and_evidence(tmp_path):
    """assess.yml's record of a refused host (the post-check role's `refused` entry point,
    run for real on the captured VMware-like lab guest's tree) reaches fleet.json,
    report.md and report.html; assessing a host that is not deceptive removes its record."""
    tree = tmp_path / "tree"
    with tarfile.open(REPO / "tests/fixtures/sysfs/lab-vmware-like.tar.gz") as tar:
        tar.extractall(tree, filter="data")
    playbook = tmp_path / "assess-one.yml"
    playbook.write_text(
        "- hosts: localhost\n"
        "  gather_facts: false\n"
        "  tasks:\n"
        "    - rtfleet.fleet.cpu_topology: {root: '{{ tree }}'}\n"
        "    - ansible.builtin.include_role:\n"
        "        {name: rtfleet.fleet.rtfleet_postcheck, tasks_from: refused}\n"
    )
    results = write_results(tmp_path / "results", [host_result("epyc1")])
    run = run_local_playbook(playbook, "-e", f"tree={tree}", "-e", f"rtfleet_report_dir={tmp_path}")
    assert run.returncode == 0, run.stdout + run.stderr
    fleet = build_report(results, tmp_path / "out", plots=False)
    (refused,) = fleet["refused"]
    assert refused["host"] == "localhost" and refused["shown"]["sockets"] == 8
    assert refused["summary"].startswith("virtual machine hides its CPU topology")
    assert any("sockets of 1 core each" in e for e in refused["evidence"])
    markdown = (tmp_path / "out/report.md").read_text()
    assert "## Refused hosts" in markdown and "Evidence on localhost:" in markdown
    assert "sockets of 1 core each" in (tmp_path / "out/report.html").read_text()
    assert "8 sockets, 1 NUMA node," in markdown
    # This machine is not deceptive: assessing it drops the old record.
    run = run_local_playbook(playbook, "-e", "tree=/", "-e", f"rtfleet_report_dir={tmp_path}")
    assert run.returncode == 0, run.stdout + run.stderr
    assert build_report(results, tmp_path / "out", plots=False)["refused"] == []
    assert "## Refused hosts" not in (tmp_path / "out/report.md").read_text()


def _container_record(host, stdout, *, cpus, node, rc=0, stderr=""):
    return {
        "host": host,
        "host_class": "lab",
        "runtime": "podman 4.3.1 (no kubelet here)",
        "image": "localhost/rtfleet-sampler:0123456789ab",
        "argv": ["podman", "run", "--rm", "localhost/rtfleet-sampler:0123456789ab"],
        "cpus": cpus,
        "numa_node": node,
        "next_to_unit": "ccx1",
        "rc": rc,
        "stdout": stdout,
        "stderr": stderr,
    }


def test_the_containerised_sampler_is_reported_and_gates_the_fleet(tmp_path):
    """samplers.yml's record of the sampler pod run in a container (its stdout here is a
    real `shminfer smoke --format json` that chose the nearest unit of a live server)
    reaches fleet.json and both reports; one that used another node's unit, or printed no
    result, fails the fleet with a line that says so."""
    from shminfer_serving import CPUS, serving

    with serving(cpus=CPUS[-1:]) as server:
        run = subprocess.run(
            [
                # On the CPU the record says the container was given, as podman's cpuset does.
                *("taskset", "--cpu-list", str(CPUS[0])),
                *(str(Path(sys.executable).parent / "shminfer"),),
                "smoke",
                "--match",
                server.name,
                "--requests",
                "50",
                "--format",
                "json",
                "--max-p99-ms",
                "10000",
                "--max-deschedule-p999-ms",
                "10000",
                "--max-cpu-ratio",
                "100",
                "--max-slow-infer",
                "1000",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    assert run.returncode == 0, run.stdout + run.stderr
    smoke = json.loads(run.stdout)
    node = smoke["choice"]["unit_node"]
    results = write_results(tmp_path / "results", [host_result("epyc1")])
    containers = tmp_path / "results/containers"
    containers.mkdir()
    record = _container_record("epyc1", run.stdout, cpus=[CPUS[0]], node=node)
    (containers / "epyc1.json").write_text(json.dumps(record))
    fleet = build_report(results, tmp_path / "out", plots=False)
    (entry,) = fleet["containers"]
    assert entry["smoke"]["unit"] == server.name and entry["smoke"]["passed"]
    assert fleet["verdict"]["passed"], fleet["verdict"]
    markdown = (tmp_path / "out/report.md").read_text()
    assert "## Containerised sampler" in markdown and "No kubelet ran here." in markdown
    assert f"| epyc1 | {CPUS[0]} (node {node}) | {server.name} on node {node} (" in markdown
    assert "Containerised sampler" in (tmp_path / "out/report.html").read_text()
    # On another node than its unit: the fleet fails, and says which.
    (containers / "epyc1.json").write_text(
        json.dumps(_container_record("epyc1", run.stdout, cpus=[CPUS[0]], node=node + 1))
    )
    fleet = build_report(results, tmp_path / "out", plots=False)
    assert not fleet["verdict"]["passed"]
    assert f"(node {node + 1}) used unit {server.name} on node {node}" in fleet["verdict"]["reason"]
    # Given other CPUs than it ran on (its own record says where): the fleet fails too.
    if len(CPUS) > 1:
        (containers / "epyc1.json").write_text(
            json.dumps(_container_record("epyc1", run.stdout, cpus=[CPUS[1]], node=node))
        )
        fleet = build_report(results, tmp_path / "out", plots=False)
        assert not fleet["verdict"]["passed"]
        assert (
            f"containerised sampler ran on CPUs {CPUS[0]}, not on the CPUs {CPUS[1]} it was given"
            in fleet["verdict"]["reason"]
        )
        markdown = (tmp_path / "out/report.md").read_text()
        assert f"| epyc1 | ran on {CPUS[0]}, given {CPUS[1]} (node {node}) |" in markdown
    # A container that never printed its result (podman refused to start it).
    crashed = _container_record(
        "epyc1", "", cpus=[CPUS[0]], node=node, rc=125, stderr="Error: crun: cannot set cpuset"
    )
    (containers / "epyc1.json").write_text(json.dumps(crashed))
    fleet = build_report(results, tmp_path / "out", plots=False)
    assert (
        "printed no result (exit 125): Error: crun: cannot set cpuset" in fleet["verdict"]["reason"]
    )
    (containers / "broken.json").write_text("{")
    fleet = build_report(results, tmp_path / "out", plots=False)
    assert [e["host"] for e in fleet["containers"]] == ["broken", "epyc1"]


def test_hostile_strings_in_a_result_are_escaped_in_html_and_markdown(tmp_path):
    """A result file is data from a host: its strings reach report.html escaped and
    report.md's tables without breaking a row (both come from one document, report_doc)."""
    evil = '<script>alert(1)</script> | <img src=x onerror="y"> `id`\nsecond line'
    result = host_result("epyc1", consistency=[{"check": evil, "ok": False, "detail": evil}])
    result["kernel"]["cmdline"] = "quiet `rm -rf /` <b>"
    results = write_results(tmp_path / "results", [result])
    build_report(results, tmp_path / "out", plots=False)
    page = (tmp_path / "out" / "report.html").read_text()
    assert "<script" not in page.lower() and "<img src=x" not in page and "<b>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    markdown = (tmp_path / "out" / "report.md").read_text()
    rows = [line for line in markdown.splitlines() if "alert(1)" in line]
    # the check's own table row: both cells on one line, every | inside them escaped
    assert any(line.count(" | ") == 2 and "\\|" in line for line in rows), rows
    assert "\nsecond line" not in markdown  # a newline in a string cannot end a row
    # outside code spans no tag reaches a Markdown viewer unescaped (it would render it)
    outside_code = re.sub(r"(?<!\\)`[^`\n]*(?<!\\)`", "", markdown)
    assert not re.search(r"(?<!\\)<(script|img|/script)", outside_code)
    assert "\\<script>alert(1)\\</script>" in markdown
    assert "- cmdline: `quiet 'rm -rf /' <b>`" in markdown


def _stopped(results: Path, host: str, task: str, message: str) -> None:
    (results / "stopped").mkdir(parents=True, exist_ok=True)
    record = {"schema": 1, "host": host, "task": task, "message": message, "at": "2026-12-05"}
    (results / "stopped" / f"{host}.json").write_text(json.dumps(record))


def test_a_host_that_stopped_before_its_post_check_is_in_the_report_and_fails_it(tmp_path):
    """The rollout's rescue records where a host stopped (roles/rtfleet_postcheck/tasks/
    stopped.yml): with no post-check result at all the report still builds and says why;
    a host whose older result passed fails the fleet once it stopped in a later run."""
    results = tmp_path / "results"
    _stopped(results, "canary", "Verify the trial boot", "the trial boot <b>does not</b> match")
    fleet = build_report(results, tmp_path / "out", plots=False)
    assert fleet["verdict"]["passed"] is False
    assert fleet["verdict"]["failed_hosts"] == ["canary"]
    assert "1 host(s) stopped in their migration: canary" in fleet["verdict"]["reason"]
    md = (tmp_path / "out" / "report.md").read_text()
    html = (tmp_path / "out" / "report.html").read_text()
    assert "## Stopped migrations" in md and "Verify the trial boot" in md
    assert "<b>does not</b>" not in html and "<b>does not</b>" not in md

    results2 = write_results(tmp_path / "r2", [host_result("epyc1"), host_result("epyc2")])
    assert build_report(results2, tmp_path / "o2", plots=False)["verdict"]["passed"] is True
    _stopped(results2, "epyc2", "Deploy the inference runtime", "unit did not start")
    (tmp_path / "r2" / "stopped" / "bad.json").write_text("{not json")
    fleet = build_report(results2, tmp_path / "o2", plots=False)
    assert fleet["verdict"]["passed"] is False
    assert fleet["verdict"]["failed_hosts"] == ["bad", "epyc2"]
    assert "unreadable record" in (tmp_path / "o2" / "report.md").read_text()
    # Without results and without a stopped record, an empty directory is still an error.
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match="no post-check results"):
        build_report(tmp_path / "empty", tmp_path / "o3", plots=False)


@pytest.mark.parametrize("kind", ["refused", "stopped", "drift", "containers"])
def test_every_section_reads_a_broken_record_as_an_error_entry(tmp_path, kind):
    """The records of every section are read by one loader (report_doc.load_records): a
    record that is not JSON, not an object, missing its fields, not UTF-8, or not a file is
    an entry of its own with the error, and the report still builds and names the host."""
    results = write_results(tmp_path / "r", [host_result("epyc1")])
    records = results / kind
    records.mkdir()
    (records / "text.json").write_text("{not json")
    (records / "list.json").write_text("[1, 2]")
    (records / "empty.json").write_text("{}")
    (records / "binary.json").write_bytes(b"\xff\xfe\x00{")
    (records / "dir.json").mkdir()
    fleet = build_report(results, tmp_path / "out", plots=False)
    entries = fleet[kind]
    assert sorted(e["host"] for e in entries) == ["binary", "dir", "empty", "list", "text"]
    assert all(e["error"] for e in entries), entries
    md = (tmp_path / "out" / "report.md").read_text()
    assert "text" in md and "dir" in md


def _two_local_hosts(tmp_path) -> Path:
    inventory = tmp_path / "hosts.yml"
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory.write_text(json.dumps({"rack1": {"hosts": {"n1": local, "n2": local}}}))
    return inventory


@pytest.mark.parametrize("limit", ["n1", "rack1"])
def test_the_report_play_runs_under_limit(tmp_path, limit):
    """`ansible-playbook site.yml -l rack1` leaves localhost out of every play: the report
    play targets the flow's hosts and runs once on the controller (it was skipped: "no hosts
    matched")."""
    write_results(tmp_path / "results", [host_result("n1")])
    run = run_local_playbook(
        REPO / "playbooks" / "report.yml",
        "-i", str(_two_local_hosts(tmp_path)),
        "--limit", limit,
        RTFLEET_REPORT_DIR=str(tmp_path),
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "no hosts matched" not in run.stdout
    assert json.loads((tmp_path / "fleet.json").read_text())["verdict"]["passed"] is True
    assert run.stdout.count("TASK [rtfleet.fleet.rtfleet_postcheck : Build the fleet report]") == 1
