"""The fault drills, in order on one lab host (docs/drills.md has the table: fault, end state,
how it is checked). Each drill starts from a converged host and ends on one: its fault is
injected for real and checked to have happened, then a plain re-run must converge and the
drift guard must find nothing. The kernel command line of each drill carries its own marker
(rtfleet_drill=N, through rtfleet_host_cmdline_extra), so every drill needs a real trial
boot and the boot the host ended on can be told from the one before."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ATTACHED, BIN, HOST, REPO, kill_controller

from rtfleet.drift_checks import CHECKS

FILES = Path(__file__).resolve().parent / "files"

pytestmark = pytest.mark.drill

HOST_PLAYBOOK = "playbooks/host.yml"
KUBELET_PLAYBOOK = "playbooks/kubelet.yml"
TRIAL_REBOOT = r"^TASK \[rtfleet\.fleet\.rtfleet_host : Reboot into the trial entry"
# The task after grub-reboot and before the reboot: every GRUB write done, nothing rebooted
# (at the reboot task's own header its worker may already have asked the host to reboot).
GRUB_WRITTEN = r"^TASK \[rtfleet\.fleet\.rtfleet_host : Note the reboot is pending\]"
# The drift guard's checks of what the host role sets (kubelet and the runtime are their own
# drills' business).
DRIFT_CHECKS = tuple(c for c in CHECKS if c not in ("units", "unit_threads", "kubelet"))


def marker(n: int) -> list[str]:
    return ["-e", json.dumps({"rtfleet_host_cmdline_extra": [f"rtfleet_drill={n}"]})]


def cmdline(lab) -> str:
    return lab.ssh("cat /proc/cmdline").strip()


def drill_marker(lab) -> int | None:
    found = re.search(r"\brtfleet_drill=(\d+)\b", cmdline(lab))
    return int(found.group(1)) if found else None


def grubenv(lab) -> dict[str, str]:
    """GRUB's environment block as grub-editenv parses it: a half-written block fails here."""
    text = lab.ssh("grub-editenv /boot/grub/grubenv list")
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def assert_converged(lab, n: int, idempotent: bool = False) -> None:
    run = lab.playbook(HOST_PLAYBOOK, *marker(n))
    assert run.returncode == 0, run.tail()
    assert drill_marker(lab) == n
    assert "next_entry" not in grubenv(lab) or not grubenv(lab)["next_entry"]
    drift = lab.drift()
    assert set(DRIFT_CHECKS) <= set(drift["checks"])
    bad = {k: v for k, v in drift["checks"].items() if k in DRIFT_CHECKS and v["status"] == "drift"}
    assert not bad, json.dumps(bad, indent=1)
    if idempotent:
        again = lab.playbook(HOST_PLAYBOOK, *marker(n))
        assert again.returncode == 0 and again.recap()["changed"] == 0, again.tail()


def test_00_the_host_converges(lab):
    assert_converged(lab, 0, idempotent=True)


# --------------------------------------------------------------------------- kubelet

INJECTOR = "/usr/local/sbin/rtfleet-drill-kubelet-fault-injector"
KUBELET = ["-e", f"rtfleet_kubelet_binary={INJECTOR}"]
DROPIN = "/etc/kubernetes/kubelet.conf.d/90-rtfleet.conf"


@pytest.fixture(scope="session", autouse=True)
def _no_stand_in_left_on_an_attached_host(lab):
    """On a host the drills only borrowed, the fault injector goes with them (on the drills'
    own host the restore drill removes it)."""
    yield
    if ATTACHED:
        lab.ssh(
            "systemctl disable --now kubelet.service; rm -f /etc/systemd/system/kubelet.service "
            f"{INJECTOR}; systemctl daemon-reload",
            check=False,
        )


def _unit_active(lab) -> str:
    return lab.ssh("systemctl is-active kubelet.service || true").strip()


HEALTHZ = (
    "import urllib.request as u; print(u.urlopen('http://127.0.0.1:10248/healthz').read().decode())"
)


def _healthz(lab) -> str:
    return lab.ssh(f'python3 -c "{HEALTHZ}" || true').strip()


@pytest.mark.ci
def test_kubelet_stand_in_is_installed_and_converges(lab):
    """The fault injector in kubelet.service's place (tests/drills/files): not a kubelet."""
    lab.ssh(
        f"install -m 0755 /dev/stdin {INJECTOR}",
        stdin=(FILES / "kubelet-fault-injector").read_text(),
    )
    unit = (FILES / "kubelet-fault-injector.service").read_text()
    lab.ssh("install -m 0644 /dev/stdin /etc/systemd/system/kubelet.service", stdin=unit)
    lab.ssh("systemctl daemon-reload && systemctl enable --now kubelet.service")
    assert _unit_active(lab) == "active" and _healthz(lab) == "ok"
    run = lab.playbook(KUBELET_PLAYBOOK, *KUBELET)
    assert run.returncode == 0, run.tail()
    assert _unit_active(lab) == "active" and _healthz(lab) == "ok"


def test_controller_killed_between_kubelets_stop_and_start(lab):
    before = lab.ssh(f"cat {DROPIN}")
    change = ["-e", "rtfleet_kubelet_cpu_manager_reconcile_period=12s"]
    run = lab.playbook(
        KUBELET_PLAYBOOK,
        *KUBELET,
        *change,
        fault=(r"^TASK \[rtfleet\.fleet\.rtfleet_kubelet : Start kubelet\]", kill_controller),
    )
    assert run.faults and run.returncode < 0, run.tail()
    # What the fault left: kubelet stopped, the new configuration already written.
    assert _unit_active(lab) != "active", "kubelet was not stopped when the controller died"
    assert lab.ssh(f"cat {DROPIN}") != before
    again = lab.playbook(KUBELET_PLAYBOOK, *KUBELET, *change)
    assert again.returncode == 0, again.tail()
    assert _unit_active(lab) == "active" and _healthz(lab) == "ok"
    assert re.search(r'cpuManagerReconcilePeriod"?\s*:\s*"?12s', lab.ssh(f"cat {DROPIN}"))
    # Every backup the runs left says what it is (a rollback can use the newest).
    backups = lab.ssh("ls -1 /var/lib/rtfleet/kubelet-backups").split()
    for backup in backups:
        lab.ssh(f"test -s /var/lib/rtfleet/kubelet-backups/{backup}/rtfleet-change.json")


@pytest.mark.ci
def test_kubelet_refuses_the_new_configuration(lab):
    before = lab.ssh(f"cat {DROPIN}")
    since = lab.ssh("date +%s").strip()
    run = lab.playbook(
        KUBELET_PLAYBOOK, *KUBELET, "-e", "rtfleet_kubelet_cpu_manager_reconcile_period=17s"
    )
    journal = lab.ssh(f"journalctl -u kubelet.service --since @{since} --no-pager -o cat")
    assert "FAULT INJECTOR (not kubelet): refusing" in journal, (
        "the stand-in never refused: no fault"
    )
    assert run.returncode != 0, "the role did not report the refused configuration"
    assert "The previous configuration and checkpoints were restored" in run.output
    assert lab.ssh(f"cat {DROPIN}") == before
    assert _unit_active(lab) == "active" and _healthz(lab) == "ok", (
        "the stand-in is not running again"
    )


# --------------------------------------------------------------------------- the runtime

RUNTIME_PLAYBOOK = "playbooks/runtime.yml"
PREFIX = "/opt/shminfer"
RUNTIME_TASK = r"^TASK \[rtfleet\.fleet\.rtfleet_runtime : %s"
PIP_INSTALL = RUNTIME_TASK % r"Install shminfer and its dependencies offline into the release"
FIRST_PROBE = RUNTIME_TASK % r"Probe the unit until it answers"


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Model sets for new releases (rtfleet_runtime_model_src), built on the controller by
    shminfer make-model: two good ones of other shapes than the default, and one OpenVINO
    cannot read (a unit started on it never answers)."""
    root = tmp_path_factory.mktemp("drill-models")
    sets = {}
    for name, hidden in (("b", "40"), ("c", "24")):
        (root / name).mkdir()
        subprocess.run([str(BIN / "shminfer"), "make-model", str(root / name / "mlp"),
                        "--hidden", hidden], check=True, capture_output=True)  # fmt: skip
        sets[name] = ["-e", f"rtfleet_runtime_model_src={root / name}"]
    bad = root / "bad"
    shutil.copytree(root / "c", bad)
    (bad / "mlp.xml").write_text('<net name="broken"')
    sets["bad"] = ["-e", f"rtfleet_runtime_model_src={bad}"]
    return sets


def _units(lab) -> list[str]:
    listing = lab.ssh("systemctl list-units --all --plain --no-legend 'shminfer@*.service'")
    return sorted(line.split()[0] for line in listing.splitlines() if line.strip())


def _serving(lab) -> dict[str, str | None]:
    """Each unit's release as its process runs it: the venv in its command line (the
    interpreter from the script's #! line, which pip wrote with the release's own path)."""
    out = {}
    for unit in _units(lab):
        pid = lab.ssh(f"systemctl show --property=MainPID --value {unit}").strip()
        cmd = lab.ssh(f"tr '\\0' ' ' < /proc/{pid}/cmdline 2>/dev/null || true")
        found = re.search(r"/releases/([0-9a-f]{16})/venv/", cmd)
        out[unit] = found.group(1) if found else None
    return out


def _link(lab, name: str) -> str:
    return lab.ssh(f"readlink {PREFIX}/{name} || true").strip().removeprefix("releases/")


def _releases(lab) -> list[str]:
    return sorted(lab.ssh(f"ls -1 {PREFIX}/releases").split())


def _probe_all(lab) -> None:
    for unit in _units(lab):
        group = unit.removeprefix("shminfer@").removesuffix(".service")
        lab.ssh(f"{PREFIX}/current/venv/bin/shminfer probe --name {group} --ready-timeout 120",
                timeout=300)  # fmt: skip


def _runtime_converged(lab, *args: str) -> str:
    """The runtime play converged: every unit on `current`, each answering; nothing
    unverified; the run after it changes nothing. Returns the serving release."""
    run = lab.playbook(RUNTIME_PLAYBOOK, *args)
    assert run.returncode == 0, run.tail()
    current = _link(lab, "current")
    assert set(_serving(lab).values()) == {current}, _serving(lab)
    lab.ssh(f"test ! -e {PREFIX}/.verifying && test -f {PREFIX}/releases/{current}/.complete")
    _probe_all(lab)
    again = lab.playbook(RUNTIME_PLAYBOOK, *args)
    assert again.returncode == 0 and again.recap()["changed"] == 0, again.tail()
    return current


def test_runtime_release_deploys_and_a_rerun_changes_nothing(lab):
    first = _runtime_converged(lab)
    assert len(_units(lab)) >= 2, "the drill needs two units to see a rolling restart"
    assert _releases(lab) == [first]
    lab.ssh(f"test ! -e /var/lib/shminfer/bundle.tar && test ! -e {PREFIX}/previous")


def _free_bytes(lab) -> int:
    return int(lab.ssh("df --output=avail -B1 /var/lib/shminfer | tail -1").strip())


FILLER = "/var/tmp/rtfleet-drill-filler"


def _fill(lab, leave_mib: int) -> str:
    size = _free_bytes(lab) - leave_mib * 2**20
    assert size > 0, f"less than {leave_mib} MiB free already"
    lab.ssh(f"fallocate -l {size} {FILLER}")
    return f"disk filled ({size >> 20} MiB), {leave_mib} MiB left"


@pytest.mark.ci
def test_a_full_disk_refuses_a_new_release_and_changes_nothing(lab, models):
    before, pids = _link(lab, "current"), _main_pids(lab)
    _fill(lab, 64)
    try:
        run = lab.playbook(RUNTIME_PLAYBOOK, *models["b"])
    finally:
        lab.ssh(f"rm -f {FILLER}")
    assert run.returncode != 0
    assert "MiB free; the runtime release" in run.output, run.tail()
    assert "Ship the bundle" not in run.output
    assert _releases(lab) == [before] and _link(lab, "current") == before
    lab.ssh("test ! -e /var/lib/shminfer/bundle.tar")
    assert _main_pids(lab) == pids, "a unit was restarted"


def _main_pids(lab) -> dict[str, str]:
    show = "systemctl show --property=MainPID --value "
    return {unit: lab.ssh(show + unit).strip() for unit in _units(lab)}


def test_the_disk_filling_during_the_install_leaves_no_half_release(lab, models):
    """The estimate cannot see another writer: here the disk fills up (from outside the run)
    once the bundle is unpacked and pip starts."""
    before, pids = _link(lab, "current"), _main_pids(lab)
    try:
        fill = (PIP_INSTALL, lambda _: _fill(lab, 4))
        run = lab.playbook(RUNTIME_PLAYBOOK, *models["b"], fault=fill)
    finally:
        lab.ssh(f"rm -f {FILLER}")
    assert run.faults, f"the run never reached the install: no fault\n{run.tail()}"
    assert run.returncode != 0
    if "failed because the disk is full" in run.output:
        # The role's rescue ran: nothing of the new release is left.
        assert _releases(lab) == [before], _releases(lab)
        lab.ssh("test ! -e /var/lib/shminfer/bundle.tar")
    else:
        # Ansible itself could not write its temporary files on the host (it reports the host
        # unreachable and no rescue runs): the release is left without `.complete`, never
        # used, and the next run's unpack removes it (the next drill installs it again).
        assert "No space left on device" in run.output, run.tail()
        assert run.recap().get("unreachable") == 1, run.tail()
        for release in set(_releases(lab)) - {before}:
            lab.ssh(f"test ! -e {PREFIX}/releases/{release}/.complete")
    assert _link(lab, "current") == before
    assert set(_serving(lab).values()) == {before}, _serving(lab)
    assert _main_pids(lab) == pids, "a unit was restarted"


def test_controller_killed_during_the_install_then_a_rerun_converges(lab, models):
    before = _link(lab, "current")

    def kill_once_pip_runs(proc) -> str:
        time.sleep(15)  # pip is writing the release's venv
        return kill_controller(proc)

    run = lab.playbook(RUNTIME_PLAYBOOK, *models["b"], fault=(PIP_INSTALL, kill_once_pip_runs))
    assert run.faults and run.returncode < 0, run.tail()
    # A release half there, not complete; the units still on the one before.
    half = [r for r in _releases(lab) if r != before]
    assert len(half) == 1, _releases(lab)
    lab.ssh(f"test ! -e {PREFIX}/releases/{half[0]}/.complete")
    assert set(_serving(lab).values()) == {before} and _link(lab, "current") == before
    new = _runtime_converged(lab, *models["b"])
    assert new == half[0] and _link(lab, "previous") == before
    assert _releases(lab) == sorted([before, new])


def test_controller_killed_during_the_rolling_restart_then_a_rerun_converges(lab, models):
    before = _link(lab, "current")
    run = lab.playbook(RUNTIME_PLAYBOOK, *models["c"], fault=(FIRST_PROBE, kill_controller))
    assert run.faults and run.returncode < 0, run.tail()
    new = _link(lab, "current")
    assert new != before
    lab.ssh(f"test -e {PREFIX}/.verifying")
    # The units after the first one still run the release before (serving).
    serving = _serving(lab)
    assert before in serving.values(), serving
    assert _runtime_converged(lab, *models["c"]) == new
    # Two releases kept: the one serving and the one before it.
    assert _releases(lab) == sorted([before, new]) and _link(lab, "previous") == before


def test_a_release_that_does_not_load_goes_back_to_the_previous(lab, models):
    good = _link(lab, "current")
    since = lab.ssh("date +%s").strip()
    # systemd waits for READY=1 (every worker answered) up to the unit's start timeout,
    # 300 s by default: the restart fails then, and the role goes back.
    run = lab.playbook(RUNTIME_PLAYBOOK, *models["bad"])
    journal = lab.ssh(f"journalctl --unit 'shminfer@*' --since @{since} --no-pager -o cat")
    assert "Unable to read the model" in journal, "no unit ever tried the bad model: no fault"
    assert run.returncode != 0
    assert f"so the units went back to release {good}" in run.output, run.tail()
    assert "answering their probes" in run.output, run.tail()
    assert _link(lab, "current") == good
    assert set(_serving(lab).values()) == {good}, _serving(lab)
    lab.ssh(f"test ! -e {PREFIX}/.verifying")
    assert good in _releases(lab) and len(_releases(lab)) == 2, _releases(lab)
    _probe_all(lab)
    # The good model again: nothing to change.
    assert _runtime_converged(lab, *models["c"]) == good


# --------------------------------------------------------------------------- two hosts
# site.yml over the drill host and a second, fresh lab host (PEER): the rollout's batches.

SITE = "site.yml"
ROLLING_PLAY = "PLAY [Roll out rtfleet, a batch at a time]"
# What rtfleet writes on a host (the host step's records, GRUB, drop-ins, units, the runtime).
WRITTEN = (
    "/etc/rtfleet /etc/default /etc/sysctl.d /etc/systemd /etc/kubernetes /etc/tuned /boot "
    "/opt /usr/local /var/lib/rtfleet /var/lib/shminfer"
)
UNTOUCHED_MARK = "/run/rtfleet-drill-untouched"


def _site_args(lab, models) -> list[str]:
    """site.yml's arguments that change nothing on a drill host the earlier drills left
    converged: its own command-line marker, the kubelet stand-in when it is installed, the
    runtime's current model set. On a fresh host the same arguments make a first rollout."""
    args = list(models["c"])
    n = drill_marker(lab)
    if n is not None:
        args += marker(n)
    return args + _kubelet_if_installed(lab, HOST)


def _mark_untouched(lab, host: str) -> str:
    lab.ssh(f"touch {UNTOUCHED_MARK}", host=host)
    return lab.ssh("cat /proc/sys/kernel/random/boot_id", host=host).strip()


def _written_since_mark(lab, host: str) -> list[str]:
    found = lab.ssh(f"find {WRITTEN} -newer {UNTOUCHED_MARK} 2>/dev/null | sort || true", host=host)
    return found.split()


def _rolling_lines(run, host: str) -> list[str]:
    """The lines of the rolling play (the batches) that name `host`."""
    rolling = run.output.split(ROLLING_PLAY, 1)
    assert len(rolling) == 2, f"the rolling play never started\n{run.tail()}"
    body = rolling[1].split("PLAY RECAP", 1)[0]
    return [line for line in body.splitlines() if re.search(r"\[%s[\]\s-]" % host, line)]


def test_the_canary_fails_its_gate_and_no_later_batch_starts(lab, peer, models):
    """Default batches (a canary of one host, then the rest); the canary's smoke gate set
    to a p99 no host can meet (1 us)."""
    boot_id = _mark_untouched(lab, peer)
    run = lab.playbook(
        SITE,
        *_site_args(lab, models),
        "-e", "rtfleet_postcheck_smoke_max_p99_ms=0.001",
        limit=f"{HOST},{peer}",
    )  # fmt: skip
    (lab.logs / "canary-report.md").write_text(
        (lab.logs / "report" / "report.md").read_text()
        if (lab.logs / "report" / "report.md").exists()
        else ""
    )
    assert run.returncode != 0, run.tail()
    assert "Record the hosts this batch starts with" in run.output
    # The fault happened: the canary's smoke gate failed on its threshold.
    flat = " ".join(run.output.split())  # Ansible folds long messages
    assert re.search(r"smoke .*latency p99 [0-9.]+ ms > 0.001 ms", flat), run.tail()
    assert f'{HOST} failed at "' in flat and "stays cordoned" in flat, run.tail()
    # The canary is never uncordoned; the batch after it never started: PEER is named
    # nowhere in the rolling play, and nothing rtfleet writes changed on it, no reboot.
    assert "TASK [Uncordon]" not in run.output
    assert _rolling_lines(run, peer) == [], _rolling_lines(run, peer)
    assert _written_since_mark(lab, peer) == []
    assert lab.ssh("cat /proc/sys/kernel/random/boot_id", host=peer).strip() == boot_id
    # The report says why: the canary failed, with the gate's line.
    fleet = json.loads((lab.logs / "report" / "fleet.json").read_text())
    assert fleet["verdict"]["failed_hosts"] == [HOST], fleet["verdict"]
    canary = next(h for h in fleet["hosts"] if h["host"] == HOST)
    assert any("> 0.001 ms" in f for f in canary["gate"]["failures"]), canary["gate"]
    assert peer not in {h["host"] for h in fleet["hosts"]}
    assert [e["host"] for e in fleet["stopped"]] == [HOST], fleet["stopped"]


# The peer's host step, half done: its sysctls persisted, rtfleet-host-tune installed and
# enabled, the system slices about to be confined; no GRUB write, no plan record yet.
PEER_CUT = r"^TASK \[rtfleet\.fleet\.rtfleet_host : Confine the system slices to the housekeeping"


def test_a_host_lost_in_the_middle_of_a_batch_is_counted_and_the_rest_go_on(lab, peer, models):
    """One batch of both hosts, rtfleet_max_fail_percentage 50; PEER's power cut in the
    middle of its host step (QEMU killed: from the controller it is unreachable)."""

    def cut(proc) -> str:
        pid = lab.qemu_pid(peer)
        lab.cli("power", peer, "off")
        return f"power cut of {peer} (QEMU {pid} killed) in the middle of its host step"

    settings = {"rtfleet_serial": 2, "rtfleet_max_fail_percentage": 50}
    run = lab.playbook(
        SITE,
        *_site_args(lab, models),
        "-e", json.dumps(settings),
        limit=f"{HOST},{peer}",
        fault=(PEER_CUT, cut),
    )  # fmt: skip
    assert run.faults, f"the run never reached {PEER_CUT}: no fault was injected\n{run.tail()}"
    assert lab.qemu_pid(peer) is None, "QEMU of the peer still runs: the power was not cut"
    assert re.search(r"2 host\(s\), batches of \[?2\]?, stopping when more than 50 %", run.output)
    # PEER counted as lost, within 50 %: the rollout went on (the report play ran) and
    # HOST ran its migration to the end, gates passed and uncordoned.
    flat = " ".join(run.output.split())  # Ansible folds long messages
    assert run.recap(peer).get("unreachable", 0) >= 1, run.recap(peer)
    assert f"1 of 2 host(s) of this batch failed or were unreachable ({peer})" in flat
    assert "is within rtfleet_max_fail_percentage 50 %" in flat, run.tail()
    assert run.recap(HOST).get("failed", 1) == 0, run.tail()
    assert re.search(r"^TASK \[Uncordon\]", run.output, re.M), run.tail()
    assert run.returncode != 0  # a host was lost: the run says so
    # The flow went on to its report (under --limit too), which names the lost host.
    fleet = json.loads((lab.logs / "report" / "fleet.json").read_text())
    assert [(e["host"], e["task"]) for e in fleet["stopped"]] == [(peer, "(unreachable)")]
    assert fleet["verdict"]["failed_hosts"] == [peer], fleet["verdict"]

    # PEER powered on: it boots (the host step never reached GRUB), and a plain re-run of
    # site.yml takes it to the end: the trial boot verified, the drift guard finds nothing.
    lab.power_on(peer)
    grubenv_text = lab.ssh("grub-editenv /boot/grub/grubenv list", host=peer)
    assert "next_entry=rtfleet" not in grubenv_text, grubenv_text
    again = lab.playbook(SITE, *models["c"], *_kubelet_if_installed(lab, peer), limit=peer)
    assert again.returncode == 0, again.tail()
    drift = lab.drift(peer)
    bad = {k: v for k, v in drift["checks"].items() if k in DRIFT_CHECKS and v["status"] == "drift"}
    assert not bad, json.dumps(bad, indent=1)


def _kubelet_if_installed(lab, host: str) -> list[str]:
    return KUBELET if lab.ssh(f"test -x {INJECTOR} && echo yes || true", host=host).strip() else []


# --------------------------------------------------------------------------- undo


def test_rollback_returns_to_the_rollout_before_and_a_new_rollout_converges(lab):
    before = drill_marker(lab)
    assert before is not None, "the drills before this one left no rollout to undo"
    last_good = json.loads(lab.ssh("cat /var/lib/rtfleet/boot/last-good.json"))
    previous = re.search(r"\brtfleet_drill=(\d+)\b", " ".join(last_good["args"]))
    first_rollout = lab.ssh("cat /var/lib/rtfleet/previous/generation").strip() == "none"
    run = lab.playbook("playbooks/rollback.yml", *KUBELET, "-e", "rtfleet_rollback_reboot_ok=true")
    assert run.returncode == 0, run.tail()
    assert drill_marker(lab) == (int(previous.group(1)) if previous else None)
    if first_rollout:
        # Before rtfleet's first rollout there was no rtfleet configuration: none is left
        # for systemd or the drift guard to hold the host to.
        lab.ssh("test ! -e /etc/rtfleet/plan.json && test ! -e /etc/sysctl.d/90-rtfleet.conf")
        for unit in ("rtfleet-host-tune.service", "rtfleet-drift.timer"):
            assert lab.ssh(f"systemctl is-enabled {unit} || true").strip() != "enabled", unit
    else:
        # The records are the previous rollout's again: the drift guard holds the host to them.
        host_record = json.loads(lab.ssh("cat /etc/rtfleet/host.json"))
        assert set(host_record["kernel_args"]) <= set(last_good["args"])
        drift = lab.drift()
        bad = {
            k: v for k, v in drift["checks"].items() if k in DRIFT_CHECKS and v["status"] == "drift"
        }
        assert not bad, json.dumps(bad, indent=1)
    # The snapshot is spent: a second rollback is refused in one line, nothing changed.
    listing = (
        "find /etc/rtfleet /etc/systemd/system /etc/sysctl.d -newer /var/lib/rtfleet/boot | sort"
    )
    files = lab.ssh(listing + " 2>/dev/null || true")
    again = lab.playbook("playbooks/rollback.yml", *KUBELET)
    assert again.returncode != 0
    assert "has no snapshot of its configuration before the rollout it runs" in again.output
    assert lab.ssh(listing + " 2>/dev/null || true") == files
    assert_converged(lab, before + 1)


def test_restore_refuses_an_edited_record_and_changes_nothing(lab):
    record = "/var/lib/rtfleet/original/host.json"
    # One IRQ's original affinity "edited": the record no longer matches its SHA-256.
    lab.ssh(f'cp -p {record} {record}.drill && sed -i \'0,/"0-7"/s//"0-6"/\' {record}')
    assert lab.ssh(f"cmp -s {record} {record}.drill || echo edited").strip() == "edited"
    try:
        run = lab.playbook("playbooks/restore.yml")
        assert run.returncode != 0
        assert "edited or damaged" in run.output, run.tail()
        assert "Stop and remove the inference runtime" not in run.output
        lab.ssh("test -f /etc/rtfleet/plan.json && systemctl is-enabled rtfleet-host-tune.service")
    finally:
        lab.ssh(f"mv {record}.drill {record}")


def test_restore_leaves_nothing_of_rtfleet(lab):
    original = json.loads(lab.ssh("cat /var/lib/rtfleet/original/host.json"))
    # The drills' own fault injector goes first: it was never part of the host.
    lab.ssh(
        "systemctl disable --now kubelet.service; rm -f /etc/systemd/system/kubelet.service "
        f"{INJECTOR}; systemctl daemon-reload"
    )
    run = lab.playbook("playbooks/restore.yml", "-e", "rtfleet_restore_reboot_ok=true")
    assert run.returncode == 0, run.tail()
    assert cmdline(lab) == original["boot"]["cmdline"]
    # The operators' check, from the collection's testinfra suite, against the kept record.
    check = subprocess.run(
        [
            str(BIN / "pytest"),
            str(REPO / "tests/infra/test_restored.py"),
            "-p", "no:cacheprovider",
            "--sudo",
            f"--hosts=ansible://{HOST}",
            f"--ansible-inventory={lab.state / 'inventory.yml'}",
        ],
        env={**lab.env, "RTFLEET_RESTORE_RECORD_DIR": str(lab.logs / "report/restore")},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )  # fmt: skip
    (lab.logs / "restored-check.log").write_text(check.stdout + check.stderr)
    assert check.returncode == 0 and " 2 passed" in check.stdout, check.stdout[-3000:]
    # Nothing left to restore: a second restore is refused in one line.
    again = lab.playbook("playbooks/restore.yml")
    assert again.returncode != 0
    assert "rtfleet never changed this host" in again.output


# --------------------------------------------------------------------------- the trial boot
# Last: each needs a trial boot (about 10 min on the 8-vCPU guest under TCG).


@pytest.mark.parametrize(
    ("n", "at"),
    [
        # the trial script written, grub.cfg not yet regenerated
        (1, r"^TASK \[rtfleet\.fleet\.rtfleet_host : Regenerate grub.cfg with the trial entry\]"),
        # every GRUB write done (trial entry, saved default, last-good record, next_entry)
        (2, GRUB_WRITTEN),
    ],
)
def test_controller_killed_during_the_grub_writes(lab, n, at):
    before = drill_marker(lab)
    run = lab.playbook(HOST_PLAYBOOK, *marker(n), fault=(at, kill_controller))
    assert run.faults, f"the run never reached {at}: no fault was injected\n{run.tail()}"
    assert run.returncode < 0, f"ansible-playbook was not killed (rc {run.returncode})"
    # The host did not reboot: it still runs the last good boot, with a readable grubenv.
    assert drill_marker(lab) == before
    grubenv(lab)
    assert_converged(lab, n)


def _power_cut(lab, wait_for_kernel: bool):
    def cut(proc) -> str:
        serial = lab.state / "hosts" / HOST / "serial.log"
        what = "before the reboot"
        if wait_for_kernel:
            boots = serial.read_text(errors="replace").count("Linux version")
            deadline = time.monotonic() + 600
            while serial.read_text(errors="replace").count("Linux version") == boots:
                assert time.monotonic() < deadline, "the trial kernel never started booting"
                time.sleep(0.5)
            what = "while the trial kernel boots"
        pid = lab.qemu_pid()
        lab.cli("power", HOST, "off")
        kill_controller(proc)
        return f"power cut {what} (QEMU {pid} killed), controller killed"

    return cut


def test_power_loss_before_the_trial_is_verified(lab):
    before = drill_marker(lab)
    run = lab.playbook(HOST_PLAYBOOK, *marker(3), fault=(GRUB_WRITTEN, _power_cut(lab, False)))
    assert run.faults and "power cut" in run.faults[0], run.tail()
    assert lab.qemu_pid() is None, "QEMU still runs: the power was not cut"
    lab.power_on()
    # The one-shot trial (if GRUB's next_entry reached the disk) or the last good entry;
    # never anything else, and a grubenv GRUB and grub-editenv can read.
    assert drill_marker(lab) in (before, 3)
    grubenv(lab)
    assert_converged(lab, 3)


def test_power_loss_while_the_trial_kernel_boots(lab):
    before = drill_marker(lab)
    run = lab.playbook(HOST_PLAYBOOK, *marker(4), fault=(TRIAL_REBOOT, _power_cut(lab, True)))
    assert run.faults and "while the trial kernel boots" in run.faults[0], run.tail()
    lab.power_on()
    # GRUB cleared the one-shot entry when it started the trial: the next boot is the last
    # good entry, and the trial is not the default.
    assert drill_marker(lab) == before
    assert not grubenv(lab).get("next_entry")
    assert_converged(lab, 4)
