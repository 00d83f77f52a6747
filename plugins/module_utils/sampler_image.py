"""The lab's sampler container image, built on the controller.

Where no kubelet can be had, the rtfleet_sampler role runs each host's sampler manifest with
podman (its ``container`` entry point). The image is a Debian root file system (the base tar
that the role's ``files/build-sampler-base.sh`` builds from Debian packages) plus the
runtime's own wheels, from the bundle the node runs, unpacked onto an import path (a wheel is
a zip: no pip, nothing byte-compiled; OpenVINO stays out, the sampler is a client) and a
``shminfer`` launcher. It is one tar, gzipped at level 1 (a third of the bytes to ship for
a second's work), which the node turns into an image with one ``podman import``
(``IMPORT_CHANGES``). It is built here and not on the node because, under
emulation, a ``podman build`` of the same image took 7 minutes of a CI run.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
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


def find_bundle(wheelhouse: str | os.PathLike, sha256: str) -> Path:
    """The bundle in WHEELHOUSE whose SHA-256 is SHA256 (what the node's `.complete` holds)."""
    if not re.fullmatch(r"[0-9a-f]{64}", sha256 or ""):
        raise ImageError(
            f"the node's release names bundle {sha256!r}, not a SHA-256: run the runtime "
            "step (rtfleet.fleet.runtime) on it again"
        )
    for path in sorted(Path(wheelhouse).glob("bundle-*.tar")):
        if file_sha256(path) == sha256:
            return path
    raise ImageError(
        f"no bundle in {wheelhouse} is the one the node runs ({sha256[:12]}): run the "
        "runtime step (rtfleet.fleet.runtime) from this controller first"
    )


def image_name(base: Path, bundle_sha256: str) -> str:
    """The image's name: its inputs' (the base's name carries its builder's hash)."""
    key = f"{FORMAT}\0{base.name}\0{base.stat().st_size}\0{bundle_sha256}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _inside(name: str, where: str) -> str:
    path = PurePosixPath(name)
    if not name or name.startswith("/") or ".." in path.parts or "\\" in name:
        raise ImageError(f"{where}: member {name!r} leaves its directory: build the bundle again")
    return str(path)


def _wheels(bundle: Path):
    """(name, bytes) of each wheel in the bundle that goes into the image."""
    try:
        with tarfile.open(bundle, "r:") as tar:
            for member in tar:
                parts = PurePosixPath(member.name).parts
                if not (member.isreg() and len(parts) == 2 and parts[0] == "wheels"):
                    continue
                if not parts[1].endswith(".whl") or parts[1].lower().startswith(LEFT_OUT):
                    continue
                yield parts[1], tar.extractfile(member).read()
    except tarfile.TarError as exc:
        raise ImageError(f"{bundle}: not a runtime bundle ({exc}): build it again") from None


def image_files(bundle: Path) -> dict[str, tuple[bytes, int]]:
    """{path in the image: (bytes, mode)}: every wheel's files under SITE, the launcher."""
    files: dict[str, tuple[bytes, int]] = {}
    wheels = 0
    for wheel, data in _wheels(bundle):
        wheels += 1
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as whl:
                for info in whl.infolist():
                    if info.is_dir():
                        continue
                    path = f"{SITE}/{_inside(info.filename, wheel)}"
                    mode = 0o755 if (info.external_attr >> 16) & 0o111 else 0o644
                    files[path] = (whl.read(info), mode)
        except (zipfile.BadZipFile, zipfile.LargeZipFile) as exc:
            raise ImageError(f"{bundle}: {wheel} is not a wheel ({exc}): build it again") from None
    if not wheels:
        raise ImageError(f"{bundle} holds no wheel for the sampler: build it again")
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
    base: os.PathLike | str, bundle: os.PathLike | str, dest: os.PathLike | str
) -> dict:
    """Write DEST/sampler-NAME.tar.gz from BASE and BUNDLE unless it is there already.

    Returns {"path", "name", "tag", "changes", "changed"}; the tar is replaced atomically, so
    a killed build leaves no image behind that a later run would take.
    """
    base, bundle, dest = Path(base), Path(bundle), Path(dest)
    if not base.is_file():
        raise ImageError(f"{base} is missing: build it (build-sampler-base.sh)")
    name = image_name(base, file_sha256(bundle))
    out = dest / f"sampler-{name}.tar.gz"
    result = {"path": str(out), "name": name, "tag": f"{TAG}:{name}"}
    result["changes"] = list(IMPORT_CHANGES)
    if out.is_file():
        return {**result, "changed": False}
    files = image_files(bundle)
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
