"""Reproducible tar bundles: what the runtime role ships to a node in one transfer.

The same members give the same bytes (sorted names, fixed mtime, root:root, fixed modes,
uncompressed: wheels and models compress poorly and the node unpacks faster), so the
role's copy changes nothing when nothing changed. Each directory in the bundle gets a
``SHA256SUMS`` that the node checks (``sha256sum --check``) before it uses the files.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

BLOCK = 4096  # what a file takes on disk, at least: ext4's and XFS's usual block

# 1980-01-01, the epoch zip (wheels) can represent; also the role's SOURCE_DATE_EPOCH.
MTIME = 315532800
CHUNK = 1 << 20


class BundleError(ValueError):
    """A member spec that cannot be bundled; the message says what to fix."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def parse_members(specs: list[str]) -> dict[str, Path]:
    """``DIR/NAME=PATH`` or ``DIR=PATH`` (NAME is PATH's) -> {DIR/NAME: path}."""
    members: dict[str, Path] = {}
    for spec in specs:
        arcname, sep, path = spec.partition("=")
        if sep and path and "/" not in arcname.strip("/"):
            arcname = f"{arcname.strip('/')}/{PurePosixPath(path).name}"
        parts = PurePosixPath(arcname).parts
        if not sep or not path or len(parts) != 2 or ".." in parts or arcname.startswith("/"):
            raise BundleError(
                f"member {spec!r}: write DIR/NAME=PATH or DIR=PATH, e.g. wheels=/tmp/x.whl"
            )
        if parts[1] == "SHA256SUMS":
            raise BundleError(f"member {spec!r}: SHA256SUMS is written by the bundle itself")
        if arcname in members:
            raise BundleError(f"member {arcname!r} is given twice")
        source = Path(path)
        if not source.is_file():
            raise BundleError(f"member {arcname!r}: {path} is not a file")
        members[arcname] = source
    if not members:
        raise BundleError("no members: give at least one DIR/NAME=PATH")
    return members


def tar_file_info(name: str, size: int, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = MTIME
    info.mode = mode
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _on_disk(size: int) -> int:
    return -(-size // BLOCK) * BLOCK if size else 0


def release_bytes(members: dict[str, Path]) -> int:
    """What a node's release of these members takes on disk, over-estimated: every member
    as unpacked from the bundle, plus every file of every wheel as pip installs it into the
    release's venv, plus a byte-compiled copy of each ``.py`` (pip compiles on install;
    counted at twice the source, a ``.pyc`` of constant-heavy code is larger than it), a
    block for each directory, each file rounded up to whole blocks. The runtime role checks
    the node has this free before it ships anything."""
    total = 0
    for arcname, source in members.items():
        total += _on_disk(source.stat().st_size)
        if not arcname.endswith(".whl"):
            continue
        try:
            with zipfile.ZipFile(source) as wheel:
                directories = set()
                for entry in wheel.infolist():
                    total += _on_disk(entry.file_size)
                    parent = PurePosixPath(entry.filename).parent
                    directories.update([parent, *parent.parents])
                    if entry.filename.endswith(".py"):
                        total += _on_disk(2 * entry.file_size)
                        directories.add(parent / "__pycache__")
                total += BLOCK * len(directories)
        except zipfile.BadZipFile as exc:
            raise BundleError(f"member {arcname!r}: {source} is not a wheel (zip): {exc}") from exc
    return total


MIB = 1 << 20


def space_checks(df_lines: list[str], bundle: int, release: int, min_free_mib: int) -> list:
    """What must fit where, from ``df --output=source,avail --block-size=1 DATA_DIR
    PREFIX/releases``: ``[{"fs", "free", "need", "free_mib", "need_mib", "what"}]``, bytes
    and whole MiB (free rounded down, need up). The bundle lands in the data directory and
    the release under the prefix; one filesystem holding both needs room for both at once
    (the bundle is removed after the install), each with ``min_free_mib`` left over."""
    rows = [line.split() for line in df_lines[1:]]
    if len(rows) != 2 or any(len(r) != 2 or not r[1].isdigit() for r in rows):
        raise BundleError("df printed %r, not a source and free bytes per path" % df_lines)
    bundle, release, reserve = int(bundle), int(release), int(min_free_mib) * MIB
    bundle_what = "%d MiB bundle" % -(-bundle // MIB)
    release_what = "%d MiB installed" % -(-release // MIB)
    if rows[0][0] == rows[1][0]:
        places = [(rows[0], bundle + release, bundle_what + ", " + release_what)]
    else:
        places = [(rows[0], bundle, bundle_what), (rows[1], release, release_what)]
    checks = []
    for (fs, free), need, what in places:
        checks.append(
            {
                "fs": fs,
                "free": int(free),
                "need": need + reserve,
                "free_mib": int(free) // MIB,
                "need_mib": -(-(need + reserve) // MIB),
                "what": what,
            }
        )
    return checks


def write_bundle(out: str | os.PathLike, specs: list[str]) -> dict:
    """Write the bundle to OUT unless OUT already holds the same bytes.

    Returns {"path", "sha256", "changed", "members", "bytes", "release_bytes"} (the tar's
    size and what its release takes on a node, release_bytes()); OUT is replaced atomically.
    """
    members = parse_members(specs)
    out = Path(out)
    sums: dict[str, list[str]] = {}
    for arcname in sorted(members):
        directory, name = arcname.split("/")
        sums.setdefault(directory, []).append(f"{file_sha256(members[arcname])}  {name}\n")

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with (
            os.fdopen(fd, "wb") as raw,
            tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):
            for directory in sorted(sums):
                tar.addfile(tar_dir_info(directory))
                entries = sorted(a for a in members if a.startswith(directory + "/"))
                for arcname in entries:
                    source = members[arcname]
                    with source.open("rb") as handle:
                        tar.addfile(tar_file_info(arcname, source.stat().st_size, 0o644), handle)
                listing = "".join(sums[directory]).encode()
                tar.addfile(
                    tar_file_info(f"{directory}/SHA256SUMS", len(listing), 0o644),
                    io.BytesIO(listing),
                )
        digest = file_sha256(Path(tmp))
        changed = not (out.is_file() and file_sha256(out) == digest)
        if changed:
            os.chmod(tmp, 0o644)
            os.replace(tmp, out)
        else:
            os.unlink(tmp)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return {
        "path": str(out),
        "sha256": digest,
        "changed": changed,
        "members": len(members),
        "bytes": out.stat().st_size,
        "release_bytes": release_bytes(members),
    }


def tar_dir_info(name: str) -> tarfile.TarInfo:
    info = tar_file_info(name, 0, 0o755)
    info.type = tarfile.DIRTYPE
    return info
