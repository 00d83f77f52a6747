"""What the documentation says about the repository is true of it (issue 26).

Read from the files themselves: every relative link and every repository path the Markdown
names exists; every extra an install hint names is declared; the role READMEs' statements
about CI name scenarios that exist, on the hosts and with the steps they have; the versions
the docs and metadata state agree with each other and with what CI installs. Run histories
(docs/dev/runs.md, docs/dev/issue-13-note.md, the changelog) name what was true then and are
left out.
"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from shminfer import leases, limits
from shminfer.codec import MAX_ARRAYS
from shminfer.queue import QUEUE_WAIT_MAX_NS
from shminfer.server import Server

HISTORY = {"docs/dev/runs.md", "docs/dev/issue-13-note.md", "CHANGELOG.rst"}
MARKDOWN = [
    p
    for p in [
        REPO / "README.md",
        *sorted((REPO / "docs").rglob("*.md")),
        *sorted(REPO.glob("roles/*/README.md")),
        *sorted(REPO.glob("shminfer/README*")),
        REPO / "lab/README.md",
    ]
    if str(p.relative_to(REPO)) not in HISTORY
]
# What running things makes inside the tree: named in the docs, never in the repository.
GENERATED = ("lab/.state/", ".state/", "reports/", ".logs/", "dist/")
TEXT_SUFFIXES = {".md", ".py", ".yml", ".yaml", ".toml", ".txt", ".cfg", ".j2", ".sh", ".rst", ""}
SKIP_DIRS = {"reports", "build", "dist", "__pycache__", "changelogs"}


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _first(pattern: str, rel: str) -> str:
    """The first group of pattern's first match in the repository's file rel."""
    return re.search(pattern, (REPO / rel).read_text()).group(1)


def _text_files():
    """Every text file of the repository but histories, caches and build output."""
    for top, dirs, names in os.walk(REPO):
        dirs[:] = sorted(
            d
            for d in dirs
            if not d.startswith(".") and d not in SKIP_DIRS and not d.endswith(".egg-info")
        )
        for name in sorted(names):
            path = Path(top) / name
            if path.suffix in TEXT_SUFFIXES and not path.is_symlink() and _rel(path) not in HISTORY:
                try:
                    yield path, path.read_text()
                except UnicodeDecodeError:
                    continue


@pytest.mark.parametrize("doc", MARKDOWN, ids=_rel)
def test_every_relative_link_exists(doc):
    broken = []
    for target in re.findall(r"\[[^\]\n]*\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        if not (doc.parent / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, "\n".join(broken)


def _looks_like_a_path(text: str) -> bool:
    if " " in text or "/" not in text or "://" in text:
        return False
    if text.startswith(("/", "~", "$", ".venv")) or any(c in text for c in "*{}<>=:|\\"):
        return False
    return text.endswith("/") or re.search(r"\.[A-Za-z0-9]+$", text) is not None


@pytest.mark.parametrize("doc", MARKDOWN, ids=_rel)
def test_every_repository_path_named_in_backticks_exists(doc):
    # A path is the repository's when its first component is an entry of the repository's
    # root or of the document's own directory (a role's `meta/argument_specs.yml`); others
    # (`reports/`, `wheels/` on a node) are places the docs describe, not files of this tree.
    bases = [REPO, doc.parent]
    missing = []
    for quoted in re.findall(r"`([^`\n]+)`", doc.read_text()):
        name = quoted.strip()
        if not _looks_like_a_path(name) or name.startswith(GENERATED):
            continue
        first = name.split("/")[0]
        if not any((base / first).exists() for base in bases):
            continue
        if not any((base / name).exists() for base in bases):
            missing.append(name)
    assert not missing, "\n".join(missing)


def test_every_doc_and_test_a_comment_names_exists():
    named = re.compile(r"(?<![\w/.-])((?:docs/[\w.-]+\.md)|(?:tests/[\w/.-]+\.py))\b")
    missing = []
    for path, text in _text_files():
        for name in named.findall(text):
            if not (REPO / name).exists():
                missing.append("%s: %s" % (_rel(path), name))
    assert not missing, "\n".join(missing)


def _extras(pyproject: Path) -> tuple[str, set[str]]:
    text = pyproject.read_text()
    name = re.search(r'(?m)^name = "([^"]+)"', text).group(1)
    section = re.search(r"(?ms)^\[project\.optional-dependencies\]\n(.*?)(?=^\[)", text).group(1)
    return name, set(re.findall(r"(?m)^([A-Za-z0-9_-]+)\s*=", section))


def test_every_extra_an_install_hint_names_is_declared():
    declared = dict(_extras(p) for p in (REPO / "pyproject.toml", REPO / "shminfer/pyproject.toml"))
    wrong = []
    for path, text in _text_files():
        if path.name == Path(__file__).name:
            continue
        pattern = r"\b(%s)\[([A-Za-z0-9_,-]+)\]" % "|".join(declared)
        for package, extras in re.findall(pattern, text):
            for extra in extras.split(","):
                if extra not in declared[package]:
                    wrong.append("%s: %s[%s]" % (_rel(path), package, extra))
    assert not wrong, "declared %s:\n%s" % (declared, "\n".join(wrong))


def _makefile_ci_scenarios() -> list[str]:
    return _first(r"(?m)^MOLECULE_SCENARIOS \?= (.+)$", "Makefile").split()


def _scenario(name: str) -> dict:
    return yaml.safe_load((REPO / "molecule" / name / "molecule.yml").read_text())


# How the READMEs name the lab's host shapes (lab/topologies/), besides their file names.
SHAPES = {"EPYC-like": "epyc-", "server-shaped": "server-", "VMware-like": "vmware-like"}


def _test_bullets(readme: Path):
    """The bullets of a role README's `## Tests` section, each as one line."""
    section = readme.read_text().partition("\n## Tests\n")[2].split("\n## ")[0]
    return [" ".join(b.split()) for b in re.split(r"(?m)^- ", section) if b.strip()]


@pytest.mark.parametrize("readme", sorted(REPO.glob("roles/*/README.md")), ids=_rel)
def test_role_readmes_say_what_the_molecule_scenarios_do(readme):
    topologies = sorted(p.stem for p in (REPO / "lab/topologies").glob("*.yml"))
    ci = _makefile_ci_scenarios()
    wrong = []
    for bullet in _test_bullets(readme):
        names = set(re.findall(r"molecule/([\w-]+)", bullet))
        names |= set(re.findall(r"molecule test -s ([\w-]+)", bullet))
        names |= set(re.findall(r"the `([\w-]+)` scenario", bullet))
        missing = sorted(n for n in names if not (REPO / "molecule" / n / "molecule.yml").exists())
        wrong += ["no scenario %s" % n for n in missing]
        names -= set(missing)
        if not names:
            continue
        if re.search(r"\bCI\b", bullet) and not names & set(ci):
            wrong.append("%s: CI runs %s" % (sorted(names), ci))
        shapes = {t for t in topologies if t in bullet}
        shapes |= {prefix for word, prefix in SHAPES.items() if word in bullet}
        run_on = [p["topology"] for n in names for p in _scenario(n)["platforms"]]
        for shape in sorted(shapes):
            if not any(t.startswith(shape) for t in run_on):
                wrong.append("%s: no %s host (%s)" % (sorted(names), shape, run_on))
        steps = {s for n in names for s in _scenario(n)["scenario"]["test_sequence"]}
        if "changed=0" in bullet and not steps & {"idempotence", "side_effect"}:
            wrong.append("%s: no second run (%s)" % (sorted(names), sorted(steps)))
    assert not wrong, "\n".join(wrong)


def test_the_runtime_docs_name_no_capability_the_unit_does_not_grant():
    unit = (REPO / "roles/rtfleet_runtime/templates/shminfer@.service.j2").read_text()
    granted = set()
    for key in ("CapabilityBoundingSet", "AmbientCapabilities"):
        for value in re.findall(r"(?m)^%s=(.*)$" % key, unit):
            granted |= set(value.split())
    named = []
    for doc in ("roles/rtfleet_runtime/README.md", "roles/rtfleet_runtime/meta/argument_specs.yml"):
        named += [
            "%s: %s" % (doc, cap)
            for cap in re.findall(r"\bCAP_[A-Z_]+", (REPO / doc).read_text())
            if cap not in granted
        ]
    assert not named, "the unit grants %s:\n%s" % (sorted(granted) or "none", "\n".join(named))


# The oldest controller Python each ansible-core release runs on (its own setup metadata).
ANSIBLE_CORE_PYTHON = {"2.16": (3, 10), "2.17": (3, 10), "2.18": (3, 11), "2.19": (3, 11)}


def test_ansible_and_python_versions_agree_everywhere():
    runtime = yaml.safe_load((REPO / "meta/runtime.yml").read_text())
    oldest = re.fullmatch(r">=(\d+\.\d+)\.\d+", runtime["requires_ansible"]).group(1)
    pinned = _first(r"(?m)^ansible-core==(\d+\.\d+)\.", "requirements/dev.txt")
    assert tuple(map(int, oldest.split("."))) <= tuple(map(int, pinned.split(".")))
    roles = {
        role.name: yaml.safe_load((role / "meta/main.yml").read_text())["galaxy_info"]
        for role in sorted((REPO / "roles").iterdir())
    }
    roles = {name: info["min_ansible_version"] for name, info in roles.items()}
    assert set(roles.values()) == {oldest}, roles
    readme = (REPO / "README.md").read_text()
    python = "%d.%d" % ANSIBLE_CORE_PYTHON[oldest]
    assert "(ansible-core ≥ %s, Python ≥ %s)" % (oldest, python) in readme
    assert "| ansible-core ≥ %s |" % oldest in readme
    # make setup installs the pinned ansible-core into .venv: the Python it needs, no older.
    venv = ANSIBLE_CORE_PYTHON[pinned]
    makefile = (REPO / "Makefile").read_text()
    assert "sys.version_info < %s" % (venv,) in makefile
    assert "rtfleet needs Python >= %d.%d" % venv in makefile


def test_shminfer_states_one_version():
    pyproject = _first(r'(?m)^version = "([^"]+)"', "shminfer/pyproject.toml")
    init = _first(r'(?m)^__version__ = "([^"]+)"', "shminfer/src/shminfer/__init__.py")
    docs = _first(r"version (\d+\.\d+\.\d+)", "docs/shminfer.md")
    assert pyproject == init == docs


def test_the_shminfer_limits_the_docs_state_are_the_code_s():
    """shminfer/README.md and the runtime role's README state the limits of issue 27 with
    the code's numbers (each behaviour is tested in tests/unit/test_shminfer_dos.py)."""
    readme = (REPO / "shminfer/README.md").read_text()
    role = (REPO / "roles/rtfleet_runtime/README.md").read_text()
    nofile = yaml.safe_load((REPO / "roles/rtfleet_runtime/defaults/main.yml").read_text())[
        "rtfleet_runtime_limit_nofile"
    ]
    low, high = inspect.signature(Server).parameters["restart_backoff_s"].default
    stated = {
        readme: [
            f"N an integer 0..{limits.MAX_LEASE_SLOTS}, at most\n  {limits.MAX_LINE} bytes",
            f"less {limits.FD_RESERVE} and {limits.FD_PER_WORKER} per worker",
            f"no line within {leases.HANDSHAKE_S:g} s",
            f"accept pauses for {leases._ACCEPT_PAUSE_S:g} s",
            f"`LimitNOFILE={nofile}`",
            f"backoff of {low:g} s that doubles on every\n  death up to {high:g} s",
            f"lived the maximum ({high:g} s)",
            f"Every {limits.HEALTH_EVERY_S:g} s (`--health-every-s`",
            f"READY for {limits.HEALTH_STUCK_S:g} s\n  (`--health-stuck-s`)",
            f"failed for {limits.HEALTH_GRACE_S:g} s (`--health-grace-s`)",
            f"more than {QUEUE_WAIT_MAX_NS // 10**9} s before it",
            f"more than {MAX_ARRAYS} arrays",
        ],
        role: [
            f"`LimitNOFILE={nofile}`",
            f"less {limits.FD_RESERVE} and {limits.FD_PER_WORKER} per worker",
            "every second",
            f"READY for {limits.HEALTH_STUCK_S:g} s",
            f"After {limits.HEALTH_GRACE_S:g} s of failed\n  checks",
        ],
    }
    missing = [text for doc, texts in stated.items() for text in texts if text not in doc]
    assert not missing, missing
    assert limits.HEALTH_EVERY_S == 1.0  # "every second"
