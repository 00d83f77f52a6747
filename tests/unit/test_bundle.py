"""rtfleet bundle: same members, same bytes; real tar and sha256sum accept what it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile

import pytest

from rtfleet import cli
from rtfleet.bundle import BundleError, write_bundle


def _wheel(path, name: str, version: str, files: dict[str, bytes]) -> None:
    """A wheel pip installs: the files, METADATA, WHEEL and RECORD."""
    info = f"{name}-{version}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as whl:
        for arcname, data in files.items():
            whl.writestr(arcname, data)
        whl.writestr(f"{info}/RECORD", record)


@pytest.fixture
def sources(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _wheel(
        src / "b-1.0-py3-none-any.whl",
        "b",
        "1.0",
        {f"b/m{i}.py": b"X = %d\n" % i * 2000 for i in range(30)}
        | {"b/blob.bin": os.urandom(70_000)},
    )
    _wheel(src / "a-2.0-py3-none-any.whl", "a", "2.0", {"a/__init__.py": b"A = 1\n"})
    (src / "mlp.xml").write_text("<net/>")
    (src / "mlp.bin").write_bytes(bytes(range(256)) * 40)
    return src


def _specs(src, *names):
    where = {"whl": "wheels"}
    return [f"{where.get(n.rsplit('.', 1)[1], 'models')}={src / n}" for n in names]


ALL = ("b-1.0-py3-none-any.whl", "a-2.0-py3-none-any.whl", "mlp.xml", "mlp.bin")


def test_same_members_give_the_same_bytes_and_no_change(tmp_path, sources):
    out = tmp_path / "out" / "bundle.tar"
    first = write_bundle(out, _specs(sources, *ALL))
    before = out.read_bytes()
    stat = out.stat()
    # other order, files touched: still the same bundle
    for path in sources.iterdir():
        os.utime(path, (1e9, 1e9))
    second = write_bundle(out, _specs(sources, *reversed(ALL)))
    assert first["changed"] and not second["changed"]
    assert first["sha256"] == second["sha256"]
    assert out.read_bytes() == before
    assert out.stat().st_ino == stat.st_ino, "an unchanged bundle must not be rewritten"
    assert not [p for p in out.parent.iterdir() if p.name != "bundle.tar"], "temp file left"


def test_a_changed_member_changes_the_bundle(tmp_path, sources):
    out = tmp_path / "bundle.tar"
    first = write_bundle(out, _specs(sources, *ALL))
    renamed = write_bundle(out, [*_specs(sources, *ALL[1:]), f"wheels/c.whl={sources / ALL[0]}"])
    assert renamed["changed"]
    first = write_bundle(out, _specs(sources, *ALL))
    (sources / "mlp.bin").write_bytes(b"other weights")
    second = write_bundle(out, _specs(sources, *ALL))
    assert second["changed"] and second["sha256"] != first["sha256"]


def test_gnu_tar_and_sha256sum_accept_it(tmp_path, sources):
    out = tmp_path / "bundle.tar"
    write_bundle(out, _specs(sources, *ALL))
    dest = tmp_path / "x"
    dest.mkdir()
    subprocess.run(["tar", "-x", "--no-same-owner", "-f", str(out), "-C", str(dest)], check=True)
    assert sorted(p.name for p in (dest / "wheels").iterdir()) == [
        "SHA256SUMS",
        "a-2.0-py3-none-any.whl",
        "b-1.0-py3-none-any.whl",
    ]
    for directory in ("wheels", "models"):
        subprocess.run(
            ["sha256sum", "--check", "--strict", "--quiet", "SHA256SUMS"],
            cwd=dest / directory,
            check=True,
        )
    # a corrupted file is caught by the node's check
    (dest / "models" / "mlp.bin").write_bytes(b"corrupt")
    bad = subprocess.run(
        ["sha256sum", "--check", "--quiet", "SHA256SUMS"], cwd=dest / "models", check=False
    )
    assert bad.returncode != 0


def test_members_are_root_owned_with_a_fixed_mtime(tmp_path, sources):
    out = tmp_path / "bundle.tar"
    write_bundle(out, _specs(sources, *ALL))
    with tarfile.open(out) as tar:
        infos = tar.getmembers()
    assert [i.name for i in infos][:2] == ["models", "models/mlp.bin"]
    assert {(i.uid, i.gid, i.mtime) for i in infos} == {(0, 0, 315532800)}
    assert {i.mode for i in infos if i.isfile()} == {0o644}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("=/etc/hostname", "DIR/NAME=PATH"),
        ("wheels/x.whl", "DIR/NAME=PATH"),
        ("a/b/c=/etc/hostname", "DIR/NAME=PATH"),
        ("../x=/etc/hostname", "DIR/NAME=PATH"),
        ("wheels/x.whl=/nonexistent", "is not a file"),
        ("models/SHA256SUMS=/etc/hostname", "written by the bundle itself"),
    ],
)
def test_bad_member_specs_are_refused_and_nothing_is_written(tmp_path, spec, message):
    """DIR=PATH takes PATH's name; anything else must be DIR/NAME=PATH, one level deep."""
    out = tmp_path / "bundle.tar"
    with pytest.raises(BundleError, match=message):
        write_bundle(out, [spec])
    assert not list(tmp_path.iterdir())


def test_cli_prints_json_and_exits_2_on_bad_input(tmp_path, sources, capsys):
    out = tmp_path / "bundle.tar"
    assert cli.main(["bundle", "--out", str(out), *_specs(sources, *ALL)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["changed"] and result["members"] == 4
    assert cli.main(["bundle", "--out", str(out), "wheels/x.whl=/nonexistent"]) == 2
    assert "is not a file" in capsys.readouterr().err


def test_release_bytes_covers_what_pip_installs_and_compiles(tmp_path, sources):
    """The estimate the runtime role checks free space against, against a real install: the
    bundle unpacked by tar plus the wheels installed (and byte-compiled) by pip, measured by
    du in the same blocks."""
    result = write_bundle(tmp_path / "bundle.tar", _specs(sources, *ALL))
    release = tmp_path / "release"
    release.mkdir()
    subprocess.run(["tar", "-x", "-f", result["path"], "-C", str(release)], check=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
         "--target", str(release / "site"), *sorted(map(str, (release / "wheels").glob("*.whl")))],
        check=True,
    )  # fmt: skip
    assert list((release / "site").rglob("*.pyc")), "pip compiled nothing: not the install measured"
    used = int(subprocess.run(["du", "-s", "-B1", str(release)], capture_output=True, text=True,
                              check=True).stdout.split()[0])  # fmt: skip
    assert used <= result["release_bytes"] <= 3 * used, (used, result["release_bytes"])
    assert result["bytes"] == os.path.getsize(result["path"])


def test_a_wheel_that_is_not_a_zip_is_refused(tmp_path, sources):
    (sources / "bad-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    with pytest.raises(BundleError, match="is not a wheel"):
        write_bundle(tmp_path / "bundle.tar", _specs(sources, "bad-1.0-py3-none-any.whl"))


def test_space_checks_one_filesystem_needs_room_for_both_and_two_each_their_own():
    from rtfleet.bundle import MIB, space_checks

    df = ["Filesystem Avail", "/dev/vda1 %d" % (100 * MIB), "/dev/vda1 %d" % (100 * MIB)]
    (both,) = space_checks(df, 20 * MIB, 30 * MIB + 1, 16)
    assert both == {
        "fs": "/dev/vda1",
        "free": 100 * MIB,
        "need": 66 * MIB + 1,
        "free_mib": 100,
        "need_mib": 67,
        "what": "20 MiB bundle, 31 MiB installed",
    }
    df[2] = "/dev/vdb1 %d" % (40 * MIB)
    var, opt = space_checks(df, 20 * MIB, 30 * MIB, 16)
    assert (var["fs"], var["need_mib"], var["what"]) == ("/dev/vda1", 36, "20 MiB bundle")
    assert (opt["fs"], opt["need_mib"], opt["what"]) == ("/dev/vdb1", 46, "30 MiB installed")
    assert opt["free"] < opt["need"]


@pytest.mark.parametrize(
    "df",
    [
        [],
        ["Filesystem Avail"],
        ["h", "/dev/x 12"],
        ["h", "/dev/x -", "/dev/x 1"],
        ["h", "a b c", "d"],
    ],
)
def test_space_checks_refuse_output_that_is_not_dfs_in_one_line(df):
    from rtfleet.bundle import space_checks

    with pytest.raises(BundleError, match="df printed") as caught:
        space_checks(df, 1, 1, 1)
    assert "\n" not in str(caught.value)
