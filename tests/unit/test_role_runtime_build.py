"""rtfleet_runtime's controller build (tasks/build.yml): the right shminfer wheel per node.

Two nodes, both played on this machine: one of the controller's CPU architecture, which
gets the C wheel (shminfer._fast, abi3: one wheel for every Python >= 3.9), one of another
architecture, which gets the pure-Python wheel. The build runs twice: the bundles must
come out byte for byte the same (reproducible wheels, an unchanged tree ships nothing).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sysconfig
import tarfile
import zipfile

import pytest
import yaml
from conftest import run_local_playbook

ARCH = platform.machine()
OTHER = "aarch64" if ARCH == "x86_64" else "x86_64"
NODES = {"native": f"cp311-{ARCH}", "foreign": f"cp39-{OTHER}"}


def _build(tmp_path, wheelhouse, models, expect_rc=0, serial=None, **role_vars):
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(
        yaml.safe_dump({"nodes": {"hosts": {name: {"pytag": tag} for name, tag in NODES.items()}}})
    )
    play = [
        {
            "name": "Build what the runtime role ships",
            "hosts": "nodes",
            "gather_facts": False,
            **({"serial": serial} if serial else {}),
            "tasks": [
                {"ansible.builtin.set_fact": {"__rtfleet_runtime_pytag": "{{ pytag }}"}},
                {
                    "ansible.builtin.include_role": {
                        "name": "rtfleet.fleet.rtfleet_runtime",
                        "tasks_from": "build",
                    },
                    "vars": {
                        "rtfleet_runtime_wheelhouse": str(wheelhouse),
                        "rtfleet_runtime_download": False,
                        "rtfleet_runtime_model_src": str(models),
                        **role_vars,
                    },
                },
            ],
        }
    ]
    playbook = tmp_path / "build.yml"
    playbook.write_text(yaml.safe_dump(play))
    run = run_local_playbook(playbook, "-i", str(inventory), ANSIBLE_STDOUT_CALLBACK="json")
    assert run.returncode == expect_rc, run.stdout[-4000:] + run.stderr[-2000:]
    return json.loads(run.stdout)


def _stand_in_wheel(path, which: str = "numpy") -> None:
    """A wheel's place in the wheelhouse: a zip (the bundle sizes what its files take
    installed), never installed here; `which` tells two apart."""
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{which}/__init__.py", "")


def _project_wheel(bundle):
    with tarfile.open(bundle) as tar:
        names = [n for n in tar.getnames() if n.startswith("wheels/shminfer-")]
        assert len(names) == 1, names
        data = tar.extractfile(names[0]).read()
    return names[0].split("/", 1)[1], data


@pytest.mark.skipif(
    shutil.which("cc") is None
    or not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")),
    reason="no C compiler or no Python headers (python3-dev): the pure path only",
)
def test_each_node_gets_the_wheel_of_its_architecture_reproducibly(tmp_path):
    wheelhouse = tmp_path / "wheelhouse"
    models = tmp_path / "models"
    models.mkdir()
    for suffix in (".xml", ".bin", ".npz"):
        (models / f"mlp{suffix}").write_bytes(b"model " + suffix.encode())
    for tag in NODES.values():  # the dependency wheels, as an air-gapped controller has them
        (wheelhouse / tag).mkdir(parents=True)
        _stand_in_wheel(wheelhouse / tag / "numpy-2.0-cp39-none-any.whl")
    _build(tmp_path, wheelhouse, models)
    first = {tag: (wheelhouse / f"bundle-{tag}.tar").read_bytes() for tag in NODES.values()}

    name, data = _project_wheel(wheelhouse / f"bundle-{NODES['native']}.tar")
    assert name.endswith(f"-cp39-abi3-linux_{ARCH}.whl"), name
    (tmp_path / "c.whl").write_bytes(data)
    with zipfile.ZipFile(tmp_path / "c.whl") as wheel:
        assert "shminfer/_fast.abi3.so" in wheel.namelist()
    name, data = _project_wheel(wheelhouse / f"bundle-{NODES['foreign']}.tar")
    assert name.endswith("-py3-none-any.whl"), name
    (tmp_path / "pure.whl").write_bytes(data)
    with zipfile.ZipFile(tmp_path / "pure.whl") as wheel:
        assert not [n for n in wheel.namelist() if n.endswith(".so")]
        # shminfer alone, with rtfleet's topology reader inside it: a node needs nothing else
        tops = {n.split("/")[0] for n in wheel.namelist()}
        assert tops == {"shminfer", "shminfer-0.2.0.dist-info"}, tops
        assert "shminfer/topology.py" in wheel.namelist()

    out = _build(tmp_path, wheelhouse, models)
    for tag, raw in first.items():
        assert (wheelhouse / f"bundle-{tag}.tar").read_bytes() == raw, f"{tag}: not reproducible"
    bundle_tasks = [
        task
        for play in out["plays"]
        for task in play["tasks"]
        if "Bundle the wheels" in task["task"]["name"]
    ]
    assert bundle_tasks and not any(
        result.get("changed") for task in bundle_tasks for result in task["hosts"].values()
    ), "an unchanged tree must ship nothing"


def _air_gapped(tmp_path):
    wheelhouse = tmp_path / "wheelhouse"
    models = tmp_path / "models"
    models.mkdir()
    for suffix in (".xml", ".bin", ".npz"):
        (models / f"mlp{suffix}").write_bytes(b"model " + suffix.encode())
    for tag in NODES.values():
        (wheelhouse / tag).mkdir(parents=True)
        _stand_in_wheel(wheelhouse / tag / "numpy-2.0-cp39-none-any.whl")
    return wheelhouse, models


def test_a_rollout_of_one_host_per_batch_builds_each_batchs_bundle(tmp_path):
    """The rollout plays the roles a batch at a time (serial): a later batch's hosts have not
    run the runtime's preflight yet, so the build may only look at this batch's hosts (the
    two-host canary drill found it looking at every host of the play)."""
    wheelhouse, models = _air_gapped(tmp_path)
    _build(tmp_path, wheelhouse, models, serial=1)
    for tag in NODES.values():
        assert (wheelhouse / f"bundle-{tag}.tar").is_file(), tag


def test_built_wheels_given_as_artifacts_are_shipped_and_nothing_is_built(tmp_path):
    """rtfleet_runtime_shminfer_wheels: the user's CI built the wheels; the role ships those
    (the native node the wheel of its CPU, the other the pure one) and builds none."""
    wheelhouse, models = _air_gapped(tmp_path)
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    pure = artifacts / "shminfer-0.2.0-py3-none-any.whl"
    native = artifacts / f"shminfer-0.2.0-cp39-abi3-linux_{ARCH}.whl"
    _stand_in_wheel(pure, "the_pure_wheel")
    _stand_in_wheel(native, "the_native_wheel")
    _build(tmp_path, wheelhouse, models, rtfleet_runtime_shminfer_wheels=[str(pure), str(native)])
    assert _project_wheel(wheelhouse / f"bundle-{NODES['native']}.tar") == (
        native.name,
        native.read_bytes(),
    )
    assert _project_wheel(wheelhouse / f"bundle-{NODES['foreign']}.tar") == (
        pure.name,
        pure.read_bytes(),
    )
    assert not (wheelhouse / "project" / "pure").exists() or not list(
        (wheelhouse / "project" / "pure").iterdir()
    )


def test_a_node_no_given_wheel_serves_is_refused_before_any_bundle(tmp_path):
    wheelhouse, models = _air_gapped(tmp_path)
    native = tmp_path / f"shminfer-0.2.0-cp39-abi3-linux_{ARCH}.whl"
    native.write_bytes(b"the native wheel")
    out = _build(
        tmp_path, wheelhouse, models, expect_rc=2, rtfleet_runtime_shminfer_wheels=[str(native)]
    )
    failed = [
        r
        for play in out["plays"]
        for t in play["tasks"]
        for r in t["hosts"].values()
        if r.get("failed")
    ]
    assert failed and "No shminfer wheel for cp39-" in json.dumps(failed)
    assert not list(wheelhouse.glob("bundle-*.tar"))
