"""The lab's sampler image (module_utils/sampler_image, the sampler_image module), built on
the controller from a base root file system and the runtime's wheels fetched from a node.

The wheels are a release's as the runtime role leaves it on a node: its bundler
(bundle.write_bundle) packs a real pure-Python shminfer wheel built here, and the bundle is
unpacked. The image tar is unpacked and its launcher and packages are run with this Python,
from the image's import path only.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_local_playbook

from ansible_collections.rtfleet.fleet.plugins.module_utils.bundle import write_bundle
from ansible_collections.rtfleet.fleet.plugins.module_utils.sampler_image import (
    IMPORT_CHANGES,
    ImageError,
    build_image,
)


def _base(path, names=("./", "./usr/", "./usr/bin/", "./opt/", "./etc/")):
    """A root file system's tar as mmdebstrap writes it (names under ./, a symlink)."""
    with tarfile.open(path, "w") as tar:
        for name in names:
            info = tarfile.TarInfo(name.rstrip("/") or ".")
            info.type = tarfile.DIRTYPE
            info.mode = 0o755
            tar.addfile(info)
        release = b"PRETTY_NAME=base\n"
        info = tarfile.TarInfo("./etc/os-release")
        info.size = len(release)
        tar.addfile(info, io.BytesIO(release))
        link = tarfile.TarInfo("./bin")
        link.type = tarfile.SYMTYPE
        link.linkname = "usr/bin"
        tar.addfile(link)
    return path


def _wheel(path, files):
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
    return path


@pytest.fixture(scope="module")
def shminfer_wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
         "-w", str(out), str(REPO / "shminfer")],
        env={**os.environ, "SHMINFER_BUILD": "pure", "SOURCE_DATE_EPOCH": "315532800"},
        check=True,
        capture_output=True,
    )  # fmt: skip
    (wheel,) = out.glob("shminfer-*.whl")
    return wheel


def _release(tmp_path, shminfer_wheel, *extra):
    """The wheels directory of a node's release: a bundle as the runtime role writes it
    (with OpenVINO and a model), unpacked."""
    openvino = _wheel(
        tmp_path / "openvino-2026.4.0-cp311-cp311-linux_x86_64.whl",
        {"openvino/__init__.py": "raise ImportError('not in the image')\n"},
    )
    members = ["wheels=%s" % shminfer_wheel, "wheels=%s" % openvino, "models=%s" % openvino]
    members += ["wheels=%s" % path for path in extra]
    bundle = write_bundle(tmp_path / "bundle-cp311-x86_64.tar", members)["path"]
    release = tmp_path / "release"
    with tarfile.open(bundle) as tar:
        tar.extractall(release, filter="data")
    return release / "wheels"


def _members(tar_path):
    with tarfile.open(tar_path) as tar:
        return {m.name: m for m in tar}


def test_the_image_holds_the_base_the_wheels_but_openvino_and_a_launcher_that_runs(
    tmp_path, shminfer_wheel
):
    wheels = _release(tmp_path, shminfer_wheel)
    base = _base(tmp_path / "sampler-base-bookworm-0123456789ab.tar")
    built = build_image(base, wheels, tmp_path / "images")
    assert built["changed"] and built["tag"] == "localhost/rtfleet-sampler:" + built["name"]
    assert built["changes"] == list(IMPORT_CHANGES)

    members = _members(built["path"])
    for name in ("./etc/os-release", "./bin", "./opt/sampler", "./opt/sampler/site"):
        assert name in members, name
    assert members["./bin"].issym() and members["./opt/sampler/site"].isdir()
    assert members["./usr/local/bin/shminfer"].mode == 0o755
    assert "./opt/sampler/site/shminfer/client.py" in members
    assert not [n for n in members if "openvino" in n or "/models" in n]
    assert all(m.uid == 0 and m.gid == 0 for m in members.values())
    assert len([n for n in members if n.rstrip("/") == "./usr"]) == 1, "a directory twice"

    root = tmp_path / "root"
    with tarfile.open(built["path"]) as tar:
        tar.extractall(root, filter="fully_trusted")
    env = {"PYTHONPATH": str(root / "opt/sampler/site"), "PYTHONDONTWRITEBYTECODE": "1"}
    where = subprocess.run(
        [sys.executable, "-c", "import shminfer.client; print(shminfer.client.__file__)"],
        env={**os.environ, **env}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert where.stdout.startswith(str(root / "opt/sampler/site/shminfer/")), where.stdout
    launched = subprocess.run(
        [sys.executable, str(root / "usr/local/bin/shminfer"), "--help"],
        env={**os.environ, **env}, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert launched.returncode == 0 and "probe" in launched.stdout, launched.stderr[-2000:]
    assert not list(root.rglob("__pycache__")), "nothing byte-compiled in the image"


def test_the_same_inputs_name_the_same_image_and_it_is_built_once(tmp_path, shminfer_wheel):
    wheels = _release(tmp_path, shminfer_wheel)
    base = _base(tmp_path / "base-1.tar")
    first = build_image(base, wheels, tmp_path / "images")
    again = build_image(base, wheels, tmp_path / "images")
    assert first["changed"] and not again["changed"] and again["path"] == first["path"]
    other = build_image(_base(tmp_path / "base-2.tar"), wheels, tmp_path / "images")
    _wheel(wheels / "extra-1-py3-none-any.whl", {"extra/__init__.py": ""})
    newer = build_image(base, wheels, tmp_path / "images")
    assert len({first["name"], other["name"], newer["name"]}) == 3
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == sorted(
        os.path.basename(b["path"]) for b in (first, other, newer)
    ), "no temporary file left"


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no-wheels-dir", "is not a directory of wheels"),
        ("no-wheels", "holds no wheel for the sampler"),
        ("base-missing", "is missing: build it"),
        ("base-not-a-tar", "not a tar"),
        ("base-empty", "is an empty tar"),
        ("wheel-escapes", "member '../../etc/cron.d/x' leaves its directory"),
        ("wheel-absolute", "member '/etc/passwd' leaves its directory"),
        ("wheel-not-a-zip", "is not a wheel"),
    ],
)
def test_bad_input_is_one_line_and_writes_no_image(tmp_path, shminfer_wheel, case, message):
    wheels = _release(tmp_path, shminfer_wheel)
    if case == "wheel-escapes":
        _wheel(wheels / "evil-1-py3-none-any.whl", {"../../etc/cron.d/x": "* * * * *"})
    elif case == "wheel-absolute":
        _wheel(wheels / "evil-1-py3-none-any.whl", {"/etc/passwd": "x"})
    elif case == "wheel-not-a-zip":
        (wheels / "broken-1-py3-none-any.whl").write_bytes(b"PK\x03\x04 not really")
    elif case == "no-wheels":
        for path in wheels.glob("shminfer-*.whl"):
            path.unlink()  # openvino's is left: not one for the image
    elif case == "no-wheels-dir":
        wheels = tmp_path / "nowhere"
    base = _base(tmp_path / "base.tar")
    if case == "base-missing":
        base = tmp_path / "nothing.tar"
    elif case == "base-not-a-tar":
        base.write_bytes(b"\x00" * 10 + b"not a tar at all" * 64)
    elif case == "base-empty":
        tarfile.open(base, "w").close()
    with pytest.raises(ImageError, match=message) as raised:
        build_image(base, wheels, tmp_path / "images")
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "images").exists() or not list((tmp_path / "images").iterdir())


def test_the_module_builds_the_image_once(tmp_path, shminfer_wheel):
    wheels = _release(tmp_path, shminfer_wheel)
    args = {"base": str(_base(tmp_path / "base.tar")), "wheels": str(wheels)}
    args["dest"] = str(tmp_path / "images")
    task = {"rtfleet.fleet.sampler_image": args}
    bad = {
        "rtfleet.fleet.sampler_image": {**args, "wheels": str(tmp_path / "nowhere")},
        "ignore_errors": True,
    }
    play = [{"hosts": "localhost", "gather_facts": False, "tasks": [task, task, bad]}]
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump(play))
    run = run_local_playbook(playbook, ANSIBLE_STDOUT_CALLBACK="json")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    results = [t["hosts"]["localhost"] for t in json.loads(run.stdout)["plays"][0]["tasks"]]
    assert results[0]["changed"] and not results[1]["changed"]
    assert results[0]["tag"] == "localhost/rtfleet-sampler:" + results[0]["name"]
    assert Path(results[0]["path"]).is_file()
    assert results[2]["failed"]
    assert results[2]["msg"].startswith(
        "rtfleet sampler image: %s is not a directory" % (tmp_path / "nowhere")
    )


@pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed here")
def test_podman_imports_the_image_with_its_environment_and_user(tmp_path, shminfer_wheel):
    """What the role does on a node: one `podman import` with the returned changes."""
    wheels = _release(tmp_path, shminfer_wheel)
    built = build_image(_base(tmp_path / "base.tar"), wheels, tmp_path)
    tag = built["tag"] + "-test"
    changes = ["--change=" + change for change in built["changes"]]
    runroot = tempfile.mkdtemp(prefix="rtfleet-podman-", dir="/tmp")  # podman: <= 50 characters
    podman = ["podman", "--root", str(tmp_path / "store"), "--runroot", runroot]
    try:
        subprocess.run([*podman, "import", "--quiet", *changes, built["path"], tag], check=True)
        (config,) = json.loads(
            subprocess.run(
                [*podman, "image", "inspect", tag], check=True, capture_output=True
            ).stdout
        )
        assert config["Config"]["Env"] == [
            "PYTHONPATH=/opt/sampler/site",
            "PYTHONDONTWRITEBYTECODE=1",
        ]
        assert config["Config"]["User"] == "65534:65534"
        mount = subprocess.run(
            [*podman, "image", "mount", tag], check=True, capture_output=True, text=True
        ).stdout.strip()
        root = Path(mount)
        assert (root / "usr/local/bin/shminfer").stat().st_mode & 0o777 == 0o755
        assert (root / "opt/sampler/site/shminfer/client.py").is_file()
        assert (root / "etc/os-release").read_text() == "PRETTY_NAME=base\n"
    finally:
        subprocess.run([*podman, "image", "unmount", "--all"], check=False, capture_output=True)
        subprocess.run([*podman, "system", "reset", "--force"], check=False, capture_output=True)
        shutil.rmtree(runroot, ignore_errors=True)


@pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed here")
def test_restores_remove_takes_off_the_sampler_images_and_no_other(tmp_path):
    """rtfleet_sampler's `remove` (rtfleet.fleet.restore) in a podman store of its own."""
    runroot = tempfile.mkdtemp(prefix="rtfleet-podman-", dir="/tmp")
    conf = tmp_path / "storage.conf"
    conf.write_text(
        '[storage]\ndriver = "overlay"\ngraphroot = "%s"\nrunroot = "%s"\n'
        % (tmp_path / "store", runroot)
    )
    env = {**os.environ, "CONTAINERS_STORAGE_CONF": str(conf)}
    base = _base(tmp_path / "base.tar")
    names = ["localhost/rtfleet-sampler:0123456789ab", "localhost/rtfleet-sampler-base:x"]
    names += ["localhost/other:1", "localhost/rtfleet-samplers-of-mine:1"]

    def listed():
        out = subprocess.run(
            ["podman", "images", "--format", "json"], env=env, check=True, capture_output=True
        ).stdout
        return sorted({n for image in json.loads(out) for n in image.get("Names") or []})

    play = [
        {
            "hosts": "localhost",
            "gather_facts": False,
            "tasks": [
                {
                    "ansible.builtin.include_role": {
                        "name": "rtfleet.fleet.rtfleet_sampler",
                        "tasks_from": "remove",
                    }
                }
            ],
        }
    ]
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play))
    try:
        for name in names:
            subprocess.run(["podman", "import", "-q", str(base), name], env=env, check=True)
        assert listed() == sorted(names)
        run = run_local_playbook(tmp_path / "play.yml", CONTAINERS_STORAGE_CONF=str(conf))
        assert run.returncode == 0, run.stdout[-3000:]
        assert listed() == ["localhost/other:1", "localhost/rtfleet-samplers-of-mine:1"]
        again = run_local_playbook(tmp_path / "play.yml", CONTAINERS_STORAGE_CONF=str(conf))
        assert again.returncode == 0 and "changed=0" in again.stdout, again.stdout[-3000:]
    finally:
        reset = ["podman", "system", "reset", "-f"]
        subprocess.run(reset, check=False, env=env, capture_output=True)
        shutil.rmtree(runroot, ignore_errors=True)


@pytest.mark.parametrize("complete", ["../../../../etc/cron.d", "", "0123456789abcdef"])
def test_a_release_that_names_no_bundle_is_refused_in_one_line(tmp_path, complete):
    """The node's `.complete` names the wheels' directory on the controller: anything but a
    SHA-256 (a damaged or hostile node) is refused before a file is fetched or written."""
    from test_sampler import LAB, LAB_POLICY

    from rtfleet.plan_record import to_record
    from rtfleet.planner import plan_partition
    from rtfleet.topology import read_topology

    tree = tmp_path / "tree"
    with tarfile.open(LAB) as tar:
        tar.extractall(tree, filter="data")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(to_record(plan_partition(read_topology(str(tree)), LAB_POLICY))))
    (tmp_path / "prefix/current/wheels").mkdir(parents=True)
    (tmp_path / "prefix/current/.complete").write_text(complete + "\n")
    run = run_local_playbook(
        REPO / "playbooks/samplers.yml",
        "-e", f"rtfleet_host_plan_file={plan}",
        "-e", "rtfleet_runtime_group=root rtfleet_runtime_user=root rtfleet_host_class=lab",
        "-e", f"rtfleet_runtime_prefix={tmp_path / 'prefix'} rtfleet_report_dir={tmp_path / 'r'}",
        "-e", f"rtfleet_sampler_container_smoke=true rtfleet_sampler_image_cache={tmp_path / 'c'}",
    )  # fmt: skip
    assert run.returncode != 0
    assert (
        f"{tmp_path / 'prefix'}/current/.complete on localhost does not name a runtime bundle"
        in run.stdout
    )
    assert not (tmp_path / "c").exists(), "nothing fetched or built"
