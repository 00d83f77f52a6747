"""The lab's sampler container image, built on the controller.

Where no kubelet can be had, the rtfleet_sampler role runs each host's sampler manifest with
podman (its ``container`` step). The image is a Debian root file system (the base tar that
the role's ``files/build-sampler-base.sh`` builds from Debian packages) plus the runtime's
own wheels, fetched from the node's serving release (so the image always matches what the
node runs, whichever rollout put it there), unpacked onto an import path (a wheel is a zip:
no pip, nothing byte-compiled; OpenVINO stays out, the sampler is a client), and a
``shminfer`` launcher. It is one tar, gzipped at level 1 (a third of the bytes to ship for
a second's work), which the node turns into an image with one ``podman import``
(``IMPORT_CHANGES``). It is built here and not on the node because, under emulation, a
``podman build`` of the same image took 7 minutes of a CI run.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

from ansible_collections.rtfleet.fleet.plugins.module_utils.bundle import (
    file_sha256,
    tar_dir_info,
    tar_file_info,
)

SITE = "opt/sampler/site"
LAUNCHER_PATH = "usr/local/bin/shminfer"
LAUNCHER = b"#!/usr/bin/python3\nimport sys\nfrom shminfer.cli import main\nsys.exit(main())\n"
# `podman import --change` for each: what a Containerfile's ENV and USER lines would set.
IMPORT_CHANGES = (
    "ENV PYTHONPATH=/" + SITE,
    "ENV PYTHONDONTWRITEBYTECODE=1",
    "USER 65534:65534",
)
LEFT_OUT = ("openvino",)  # wheels (by distribution name) the sampler, a client, does not need
FORMAT = 1  # what goes into the image; a new FORMAT gives every image a new name
TAG = "localhost/rtfleet-sampler"


class ImageError(ValueError):
    """An input the image cannot be built from; the message says what to fix."""


def _wheel_paths(wheels: Path) -> list[Path]:
    """The wheels in WHEELS that go into the image, by name."""
    if not wheels.is_dir():
        raise ImageError(f"{wheels} is not a directory of wheels: fetch the node's wheels first")
    found = sorted(
        path
        for path in wheels.iterdir()
        if path.is_file()
        and path.name.endswith(".whl")
        and not path.name.lower().startswith(LEFT_OUT)
    )
    if not found:
        raise ImageError(f"{wheels} holds no wheel for the sampler: fetch the node's wheels again")
    return found


def image_name(base: Path, wheels: list[Path]) -> str:
    """The image's name, from its inputs: the base's name (which carries its builder's
    hash) and size, and each wheel's name and SHA-256."""
    key = [str(FORMAT), base.name, str(base.stat().st_size)]
    key += [f"{path.name}={file_sha256(path)}" for path in wheels]
    return hashlib.sha256("\0".join(key).encode()).hexdigest()[:12]


def _inside(name: str, where: str) -> str:
    path = PurePosixPath(name)
    if not name or name.startswith("/") or ".." in path.parts or "\\" in name:
        raise ImageError(f"{where}: member {name!r} leaves its directory: not a wheel to use")
    return str(path)


def image_files(wheels: list[Path]) -> dict[str, tuple[bytes, int]]:
    """{path in the image: (bytes, mode)}: every wheel's files under SITE, the launcher."""
    files: dict[str, tuple[bytes, int]] = {}
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as whl:
                for info in whl.infolist():
                    if info.is_dir():
                        continue
                    path = f"{SITE}/{_inside(info.filename, wheel.name)}"
                    mode = 0o755 if (info.external_attr >> 16) & 0o111 else 0o644
                    files[path] = (whl.read(info), mode)
        except (zipfile.BadZipFile, zipfile.LargeZipFile) as exc:
            raise ImageError(f"{wheel} is not a wheel ({exc}): fetch it again") from None
    files[LAUNCHER_PATH] = (LAUNCHER, 0o755)
    return files


def _write(out: Path, base: Path, files: dict[str, tuple[bytes, int]]) -> None:
    with (
        tarfile.open(base, "r:") as src,
        open(out, "wb") as raw,
        gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1, mtime=0) as packed,
        tarfile.open(fileobj=packed, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        prefix, seen = None, set()
        for member in src:
            if prefix is None:
                prefix = "./" if member.name == "." or member.name.startswith("./") else ""
            tar.addfile(member, src.extractfile(member) if member.isreg() else None)
            seen.add(member.name.removeprefix("./").rstrip("/"))
        if prefix is None:
            raise ImageError(f"{base} is an empty tar: build it again (--force)")
        parents = {str(p) for path in files for p in PurePosixPath(path).parents if str(p) != "."}
        for directory in sorted(parents - seen):
            tar.addfile(tar_dir_info(prefix + directory))
        for path in sorted(files):
            data, mode = files[path]
            tar.addfile(tar_file_info(prefix + path, len(data), mode), io.BytesIO(data))


def build_image(
    base: os.PathLike | str, wheels: os.PathLike | str, dest: os.PathLike | str
) -> dict:
    """Write DEST/sampler-NAME.tar.gz from BASE and the wheels in WHEELS unless it is there.

    Returns {"path", "name", "tag", "changes", "changed"}; the tar is replaced atomically, so
    a killed build leaves no image behind that a later run would take.
    """
    base, dest = Path(base), Path(dest)
    if not base.is_file():
        raise ImageError(f"{base} is missing: build it (build-sampler-base.sh)")
    found = _wheel_paths(Path(wheels))
    name = image_name(base, found)
    out = dest / f"sampler-{name}.tar.gz"
    result = {"path": str(out), "name": name, "tag": f"{TAG}:{name}"}
    result["changes"] = list(IMPORT_CHANGES)
    if out.is_file():
        return {**result, "changed": False}
    files = image_files(found)
    dest.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=dest)
    os.close(fd)
    try:
        _write(Path(tmp), base, files)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except tarfile.TarError as exc:
        raise ImageError(f"{base}: not a tar ({exc}): build it again (--force)") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return {**result, "changed": True}
