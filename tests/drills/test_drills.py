"""The fault drills, in order on one lab host (docs/drills.md has the table: fault, end state,
how it is checked). Each drill starts from a converged host and ends on one: its fault is
injected for real and checked to have happened, then a plain re-run must converge and the
drift guard must find nothing. The kernel command line of each drill carries its own marker
(rtfleet_drill=N, through rtfleet_host_cmdline_extra), so every drill needs a real trial
boot and the boot the host ended on can be told from the one before."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import BIN, HOST, REPO, kill_controller

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
DRIFT_CHECKS = (
    "cmdline",
    "isolation",
    "irqs",
    "irqbalance",
    "tuned",
    "sysctls",
    "hugepages",
    "governor",
)


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
    assert_converged(lab, 0)


# --------------------------------------------------------------------------- kubelet

INJECTOR = "/usr/local/sbin/rtfleet-drill-kubelet-fault-injector"
KUBELET = ["-e", f"rtfleet_kubelet_binary={INJECTOR}"]
DROPIN = "/etc/kubernetes/kubelet.conf.d/90-rtfleet.conf"


def _unit_active(lab) -> str:
    return lab.ssh("systemctl is-active kubelet.service || true").strip()


HEALTHZ = (
    "import urllib.request as u; print(u.urlopen('http://127.0.0.1:10248/healthz').read().decode())"
)


def _healthz(lab) -> str:
    return lab.ssh(f'python3 -c "{HEALTHZ}" || true').strip()


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
    lab.cli("power", HOST, "on")
    # The one-shot trial (if GRUB's next_entry reached the disk) or the last good entry;
    # never anything else, and a grubenv GRUB and grub-editenv can read.
    assert drill_marker(lab) in (before, 3)
    grubenv(lab)
    assert_converged(lab, 3)


def test_power_loss_while_the_trial_kernel_boots(lab):
    before = drill_marker(lab)
    run = lab.playbook(HOST_PLAYBOOK, *marker(4), fault=(TRIAL_REBOOT, _power_cut(lab, True)))
    assert run.faults and "while the trial kernel boots" in run.faults[0], run.tail()
    lab.cli("power", HOST, "on")
    # GRUB cleared the one-shot entry when it started the trial: the next boot is the last
    # good entry, and the trial is not the default.
    assert drill_marker(lab) == before
    assert not grubenv(lab).get("next_entry")
    assert_converged(lab, 4)
