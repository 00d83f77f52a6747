"""The post-check's measurement runners (roles/rtfleet_postcheck/templates/run-*.sh.j2).

Rendered with the role's variables and run for real on this machine: cyclictest and oslat
must write JSON documents that rtfleet.postcheck parses, for the CPUs asked, and the
background load must be gone when the runner ends, whether the tool succeeded or not.
run-hwlatdetect runs against this machine's real tracefs, whose kernel has no hwlat tracer:
it must say so (exit 3) and leave tracefs as it found it. Needs root and rt-tests
(`make deps` installs it).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from pathlib import Path

import jinja2
import pytest

from rtfleet.cpulist import format_cpumask, parse_cpulist
from rtfleet.postcheck_gate import gate_oslat
from rtfleet.postcheck_parse import parse_cyclictest, parse_oslat

TEMPLATES = Path(__file__).parents[2] / "roles/rtfleet_postcheck/templates"

pytestmark = pytest.mark.skipif(
    shutil.which("cyclictest") is None or shutil.which("oslat") is None or os.geteuid() != 0,
    reason="needs root, cyclictest and oslat (make deps installs rt-tests)",
)


def _render(tmp_path, name, load="", cpus="0"):
    env = jinja2.Environment(keep_trailing_newline=True)
    env.filters["rtfleet.fleet.cpumask"] = lambda text: format_cpumask(parse_cpulist(text))
    script = tmp_path / name
    text = env.from_string((TEMPLATES / f"{name}.sh.j2").read_text()).render(
        ansible_managed="test",
        __rtfleet_postcheck_load=load,
        __rtfleet_postcheck_housekeeping="0",
        __rtfleet_postcheck_cpus=cpus,
        __rtfleet_postcheck_slice="rtfleet_check.slice",
    )
    script.write_text(text)
    script.chmod(0o755)
    return script


def _cyclictest(out, priority=95, duration=2, cpus="0"):
    # The argv measure.yml passes.
    return [
        "cyclictest",
        "--quiet",
        "--mlockall",
        f"--priority={priority}",
        "--interval=1000",
        "--threads",
        f"--affinity={cpus}",
        "--mainaffinity=0",
        f"--duration={duration}",
        "--histogram=1000",
        "--histfile=/dev/null",
        f"--json={out}",
    ]


def _marker():
    """A load command no other process on the machine runs (pgrep -f sees every process:
    a fixed one matched a concurrent run of this test from another checkout)."""
    return "sleep 3%03d.%06d" % (os.getpid() % 1000, random.randrange(10**6))


def _load_alive(marker):
    return subprocess.run(["pgrep", "-f", marker], capture_output=True, check=False).returncode == 0


def _run(argv):
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


def test_runner_measures_the_cpus_and_stops_its_load(tmp_path):
    marker = _marker()
    out = tmp_path / "ct.json"
    run = _run([str(_render(tmp_path, "run-measure", marker)), *_cyclictest(out)])
    assert run.returncode == 0, run.stderr
    parsed = parse_cyclictest(out.read_text())
    assert [row["cpu"] for row in parsed["cpus"]] == [0]
    assert parsed["summary"]["cycles"] > 0
    assert not _load_alive(marker), "the background load outlived the runner"


def test_runner_stops_its_load_when_the_tool_fails(tmp_path):
    marker = _marker()
    # Priority 100 is out of range: cyclictest refuses to start.
    script = _render(tmp_path, "run-measure", marker)
    run = _run([str(script), *_cyclictest(tmp_path / "ct.json", priority=100)])
    assert run.returncode != 0
    assert not _load_alive(marker), "the background load outlived a failed run"


def test_runner_runs_oslat_as_the_role_calls_it(tmp_path):
    cpus = "0-1" if os.cpu_count() and os.cpu_count() > 1 else "0"
    out = tmp_path / "oslat.json"
    script = _render(tmp_path, "run-measure", _marker(), cpus=cpus)
    run = _run(
        [
            str(script),
            "oslat",
            "--quiet",
            f"--cpu-list={cpus}",
            "--cpu-main-thread=0",
            "--duration=2",
            "--bucket-size=32",
            f"--json={out}",
            "--rtprio=1",
        ]
    )
    assert run.returncode == 0, run.stderr
    parsed = parse_oslat(out.read_text())
    assert parsed["summary"]["cpus"] == cpus
    assert parsed["summary"]["loops"] > 0 and parsed["summary"]["bucket_us"] == 32
    # The role's coverage check agrees: every CPU asked for has a thread.
    assert not [f for f in gate_oslat(parsed, None, cpus) if "measured CPUs" in f]


def test_hwlatdetect_runner_says_the_kernel_has_no_tracer_and_restores_tracefs(tmp_path):
    with open("/proc/mounts") as fh:
        before = fh.read().count(" tracefs ")
    out = tmp_path / "hwlat.txt"
    run = _run([str(_render(tmp_path, "run-hwlatdetect", cpus="0")), str(out), "--duration=2"])
    tracers = Path("/sys/kernel/tracing/available_tracers")
    if tracers.exists() and "hwlat" in tracers.read_text().split():
        pytest.skip("this kernel has the hwlat tracer: the no-tracer path cannot be shown here")
    assert run.returncode == 3, run.stderr
    text = out.read_text()
    assert "no hwlat tracer" in text or "no tracefs" in text, text
    with open("/proc/mounts") as fh:
        assert fh.read().count(" tracefs ") == before, "the runner left a tracefs mount behind"


def test_hwlatdetect_runner_writes_the_kernels_comma_grouped_mask_past_cpu_31(tmp_path):
    # The server-shaped lab host's isolated CPUs: hwlatdetect's own --cpu-list wrote
    # "ffcffcffcffc" there and the kernel refused it (fixtures/hwlatdetect/README.md).
    text = _render(tmp_path, "run-hwlatdetect", cpus="2-11,14-23,26-35,38-47").read_text()
    assert 'echo ffcf,fcffcffc >"$tracing/tracing_cpumask"' in text
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in code if "--cpu-list" in line]
