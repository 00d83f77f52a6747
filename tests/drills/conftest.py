"""Fault drills on a lab host (`make drills`): real playbooks against a real guest, with real
faults injected from outside them: SIGKILL to ansible-playbook (a controller that dies), a
power cut (SIGKILL to the guest's QEMU, `rtfleet lab power HOST off`), a stand-in kubelet
that refuses a marked configuration (a fault injector, named as one, never reported as
kubelet). Each drill fails when its fault did not happen, and checks the end state with the
host's own checkers (rtfleet-drift --check, boot_state) after a re-run.

Not Molecule: a fault that kills ansible-playbook or the guest in the middle of a task can
only be injected by a process that watches the run from outside, which Molecule's sequence
(create, converge, side_effect, verify) has no step for.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# RTFLEET_DRILL_HOST names a lab host that is already up and converged (CI's site scenario
# runs the drills marked `ci` on its server host): the drills then use it as it is, in the
# lab state of $RTFLEET_LAB_DIR (default lab/.state), and neither boot nor remove it.
ATTACHED = os.environ.get("RTFLEET_DRILL_HOST", "")
HOST = ATTACHED or "drill"
# A second lab host, booted only for the drills of a rollout over two hosts (a canary and
# the batch after it, a batch of two that loses one).
PEER = "drill2"
TOPOLOGY = os.environ.get("RTFLEET_DRILL_TOPOLOGY", "epyc-2ccx")
# ssh wait after a power cut's power-on. A drill checks which boot entry comes up, not how
# fast: alone, the guest answers in about 80 s, but under TCG on two cores shared with other
# work its initramfs once sat out two udev timeouts and passed `rtfleet lab`'s 300 s default.
POWER_ON_TIMEOUT_S = 900


def pytest_configure(config):
    config.addinivalue_line("markers", "drill: a fault drill on a lab VM (make drills)")
    config.addinivalue_line(
        "markers",
        "ci: a drill without a reboot of its own that CI's site scenario runs on its converged "
        "server host (RTFLEET_DRILL_HOST)",
    )


@dataclass
class Run:
    argv: list[str]
    returncode: int
    output: str
    seconds: float
    faults: list[str] = field(default_factory=list)

    def recap(self, host: str = HOST) -> dict[str, int]:
        line = re.search(r"^%s\s+:\s+(.*)$" % re.escape(host), self.output, re.M)
        if not line:
            return {}
        return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line.group(1))}

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


class Lab:
    """One lab host for the drills, in a lab state directory of its own."""

    def __init__(self, state: Path, logs: Path):
        self.state = state
        self.logs = logs
        self.env = {
            **os.environ,
            # The venv's tools first (testinfra's ansible backend calls ansible-inventory),
            # also when pytest runs without `make drills`.
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "RTFLEET_LAB_DIR": str(state),
            "RTFLEET_REPORT_DIR": str(logs / "report"),
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_FORCE_COLOR": "0",
            "PYTHONUNBUFFERED": "1",
        }
        self.runs = 0

    def cli(
        self, *args: str, check: bool = True, timeout: float = 1800, stdin: str = ""
    ) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [str(BIN / "rtfleet"), "lab", *args],
            env=self.env,
            cwd=REPO,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"rtfleet lab {' '.join(args)}: {result.stdout}{result.stderr}")
        return result

    def ssh(
        self,
        command: str,
        check: bool = True,
        timeout: float = 120,
        stdin: str = "",
        host: str = HOST,
    ) -> str:
        """`command` run by sh as root on the drill host (ssh joins its arguments into one
        line for the remote shell, so the command travels quoted as one word)."""
        remote = "sudo sh -c " + shlex.quote(command)
        result = self.cli("ssh", host, "--", remote, check=False, timeout=timeout, stdin=stdin)
        if check and result.returncode != 0:
            raise AssertionError(f"on {host}: {command}: rc {result.returncode}: {result.stderr}")
        return result.stdout

    def power_on(self, host: str = HOST) -> None:
        self.cli("power", host, "on", "--timeout", str(POWER_ON_TIMEOUT_S))

    def qemu_pid(self, host: str = HOST) -> int | None:
        status = json.loads(self.cli("status", "--format", "json").stdout)
        for row in status["hosts"]:
            if row["host"] == host and row["alive"]:
                return row["pid"]
        return None

    def playbook(
        self, playbook: str, *args: str, fault=None, timeout: float = 3600, limit: str = HOST
    ) -> Run:
        """ansible-playbook PLAYBOOK ARGS against the drill host (or `limit`). `fault` is
        (pattern, action): when a line of the output matches, action(proc) injects the fault
        once and returns a description of what it did."""
        self.runs += 1
        argv = [
            str(BIN / "ansible-playbook"),
            "-i", str(REPO / "inventory/lab"),
            "-i", str(self.state / "inventory.yml"),
            playbook, "-l", limit, *args,
        ]  # fmt: skip
        log = self.logs / f"run{self.runs:02d}-{Path(playbook).stem}.log"
        start = time.monotonic()
        faults: list[str] = []
        lines: list[str] = []
        with (
            subprocess.Popen(
                argv,
                env=self.env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                bufsize=1,
                start_new_session=True,
            ) as proc,
            log.open("w") as out,
        ):
            out.write(" ".join(argv) + "\n")
            assert proc.stdout is not None
            try:
                for line in proc.stdout:
                    lines.append(line)
                    out.write(line)
                    out.flush()
                    if fault and not faults and re.search(fault[0], line):
                        faults.append(fault[1](proc))
                        out.write(f"#### DRILL FAULT: {faults[-1]}\n")
                    if time.monotonic() - start > timeout:
                        raise AssertionError(f"{playbook} ran past {timeout} s; log {log}")
            except BaseException:  # a timeout, or the drills interrupted: no run left behind
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                raise
            returncode = proc.wait()
        return Run(argv, returncode, "".join(lines), time.monotonic() - start, faults)

    def drift(self, host: str = HOST) -> dict:
        """The drift guard's own verdict on the host, checking only (no repair)."""
        text = self.ssh("/usr/local/sbin/rtfleet-drift --check --json", check=False, host=host)
        return json.loads(text)


def kill_controller(proc: subprocess.Popen) -> str:
    """SIGKILL to ansible-playbook and everything it started (its workers, ssh): a controller
    that dies mid-task, not one that is asked to stop."""
    os.killpg(proc.pid, signal.SIGKILL)
    return f"SIGKILL to ansible-playbook {proc.pid} and its process group"


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    if shutil.which("qemu-system-x86_64") is None:
        pytest.fail("qemu-system-x86_64 is not installed: make deps")
    logs = Path(os.environ.get("RTFLEET_DRILL_LOGS", REPO / ".logs" / "drills"))
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    if ATTACHED:
        lab_dir = os.environ.get("RTFLEET_LAB_DIR")
        drills = Lab(Path(lab_dir).resolve() if lab_dir else REPO / "lab" / ".state", logs)
        if drills.qemu_pid() is None:
            pytest.fail(f"RTFLEET_DRILL_HOST={HOST} is not a running lab host in {drills.state}")
        yield drills
        return
    state = tmp_path_factory.mktemp("drill-lab")
    drills = Lab(state, logs)
    drills.cli("image")
    start = time.monotonic()
    drills.cli("up", f"{HOST}={TOPOLOGY}", "--disk-cache", "writeback")
    print(f"\n{HOST} ({TOPOLOGY}) up after {time.monotonic() - start:.0f} s")
    try:
        yield drills
    finally:
        drills.cli("down", "--all", check=False)
        left = subprocess.run(
            ["pgrep", "-f", f"qemu-system.*{state}"], capture_output=True, text=True, check=False
        )
        assert left.stdout.strip() == "", f"QEMU left running after the drills: {left.stdout}"


@pytest.fixture(scope="session")
def peer(lab):
    """The second lab host, booted when a drill first needs it; removed with the first."""
    if ATTACHED:
        pytest.skip("drills over two hosts boot their own; not with RTFLEET_DRILL_HOST")
    start = time.monotonic()
    lab.cli("up", f"{PEER}={TOPOLOGY}", "--disk-cache", "writeback")
    print(f"\n{PEER} ({TOPOLOGY}) up after {time.monotonic() - start:.0f} s")
    return PEER
