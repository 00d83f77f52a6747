"""rtfleet: read a host's CPU topology, plan its partition, run the lab."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from rtfleet import __version__, lab
from rtfleet.bundle import BundleError, write_bundle
from rtfleet.checklist import ChecklistError, evaluate
from rtfleet.planner import PlanError, plan_partition
from rtfleet.postcheck import PostcheckError
from rtfleet.render import render_checklist_table, render_plan_table, render_topology_table
from rtfleet.report import build_report
from rtfleet.report_files import ReportError
from rtfleet.report_tables import host_summary, render_fleet_table
from rtfleet.sampler import KUBERNETES_VERSION, SamplerError, check_manifest_text
from rtfleet.topology import TopologyError, read_topology


def _load_policy(path: str | None) -> dict:
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except OSError as exc:
        raise PlanError(f"{path}: cannot read the policy file ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise PlanError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise PlanError(
            f"{path}: a policy is a mapping of keys to values, got {type(data).__name__}"
        )
    # Accept a policy nested under `rtfleet_policy:` so an inventory group_vars file works too.
    return dict(data.get("rtfleet_policy", data))


def _emit(data: dict, fmt: str, table) -> None:
    if fmt == "json":
        print(json.dumps(data, indent=2, sort_keys=False))
    elif fmt == "yaml":
        print(yaml.safe_dump(data, sort_keys=False, default_flow_style=None), end="")
    else:
        table(data)


def cmd_topology(args: argparse.Namespace) -> int:
    _emit(read_topology(args.root), args.format, render_topology_table)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    topology = read_topology(args.root)
    plan = plan_partition(topology, _load_policy(args.policy))
    _emit(plan, args.format, lambda p: render_plan_table(topology, p))
    return 0


def cmd_checklist(args: argparse.Namespace) -> int:
    wanted = _load_policy(args.wanted)
    waivers = wanted.pop("waivers", [])
    try:
        result = evaluate(read_topology(args.root), wanted, waivers)
    except ChecklistError as exc:
        raise PlanError(str(exc)) from None
    _emit(result, args.format, render_checklist_table)
    return 0 if result["ok"] else 1


def cmd_report(args: argparse.Namespace) -> int:
    fleet = build_report(args.results, args.out)
    files = {
        key: [str(Path(args.out) / p) for p in value]
        if isinstance(value, list)
        else str(Path(args.out) / value)
        for key, value in fleet["files"].items()
    }
    if args.format == "json":
        summary = {
            "passed": fleet["verdict"]["passed"],
            "verdict": fleet["verdict"],
            "files": files,
            "hosts": [
                {**host_summary(h), "failures": h["gate"]["failures"]} for h in fleet["hosts"]
            ],
        }
        print(json.dumps(summary, indent=2, ensure_ascii=False))
    else:
        render_fleet_table(fleet)
        print(f"report: {files['html']} (also {files['markdown']}, {files['json']})")
    return 0 if fleet["verdict"]["passed"] else 1


def cmd_bundle(args: argparse.Namespace) -> int:
    result = write_bundle(args.out, args.members)
    print(json.dumps(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rtfleet", description=__doc__)
    parser.add_argument("--version", action="version", version=f"rtfleet {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    topo = sub.add_parser("topology", help="read a Linux host's CPU topology from /sys and /proc")
    topo.add_argument("--root", default="/", help="directory holding sys/ and proc/ (default /)")
    topo.add_argument("--format", choices=("table", "json", "yaml"), default="table")
    topo.set_defaults(func=cmd_topology)

    plan = sub.add_parser("plan", help="turn the topology and a policy into one CPU partition")
    plan.add_argument("--root", default="/", help="directory holding sys/ and proc/ (default /)")
    plan.add_argument(
        "--policy", help="YAML policy file (keys: inventory/sample/group_vars/inference_nodes.yml)"
    )
    plan.add_argument("--format", choices=("table", "json", "yaml"), default="table")
    plan.set_defaults(func=cmd_plan)

    check = sub.add_parser("checklist", help="verify BIOS/firmware settings from the OS")
    check.add_argument("--root", default="/", help="directory holding sys/ and proc/ (default /)")
    check.add_argument("--wanted", help="YAML: wanted values (nps, smt, boost, ...) + waivers")
    check.add_argument("--format", choices=("table", "json", "yaml"), default="table")
    check.set_defaults(func=cmd_checklist)

    report = sub.add_parser(
        "report",
        help="fleet report from post-check results: fleet.json, report.md/.html, plots",
        description=(
            "Read every <host>.json the post-check wrote, gate each tuned host and write the "
            "report. Exit 0 when every tuned host passed, 1 when one failed (or none is "
            "tuned), 2 on unreadable input."
        ),
    )
    report.add_argument(
        "--results",
        action="append",
        required=True,
        metavar="DIR",
        help="directory of per-host results; repeat to add baseline results kept elsewhere",
    )
    report.add_argument("--out", required=True, metavar="DIR", help="where the report goes")
    report.add_argument("--format", choices=("text", "json"), default="text")
    report.set_defaults(func=cmd_report)

    bundle = sub.add_parser(
        "bundle",
        help="reproducible tar of wheels/models with a SHA256SUMS per directory",
        description=(
            "Write OUT (an uncompressed tar) from DIR/NAME=PATH members, sorted, with a fixed "
            "mtime and root ownership, plus DIR/SHA256SUMS for each DIR; OUT is left alone "
            "when it already holds the same bytes. Prints JSON with 'changed'."
        ),
    )
    bundle.add_argument("--out", required=True, metavar="OUT")
    bundle.add_argument("members", nargs="+", metavar="DIR/NAME=PATH")
    bundle.set_defaults(func=cmd_bundle)

    sampler = sub.add_parser(
        "sampler-check",
        help="check a sampler manifest: schemas, Guaranteed, mounts, group, threads",
        description=(
            "Check the Kubernetes manifest(s) of a sampler workload the way rtfleet checks "
            "its own (the rtfleet_sampler role's sampler.yaml.j2): valid against Kubernetes' "
            "schemas, "
            "Guaranteed with whole CPUs, only the host's /run/shminfer mounted, read-only, "
            "the runtime's group in supplementalGroups, no host IPC, a read-only root, no "
            "added capability, every math library's threads = its CPUs. Prints one line per "
            "broken rule; exit 0 when none, 1 otherwise."
        ),
    )
    sampler.add_argument("manifests", nargs="+", metavar="FILE")
    sampler.add_argument(
        "--gid", type=int, required=True, help="the runtime's group id on the nodes"
    )
    sampler.add_argument("--kubernetes-version", default=KUBERNETES_VERSION)
    sampler.set_defaults(func=cmd_sampler_check)

    lab.add_parser(sub)
    return parser


def cmd_sampler_check(args) -> int:
    broken = 0
    for path in args.manifests:
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except OSError as exc:
            raise SamplerError(f"{path}: {exc.strerror}") from None
        for error in check_manifest_text(text, gid=args.gid, version=args.kubernetes_version):
            print(f"{path}: {error}")
            broken += 1
    return 1 if broken else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (
        TopologyError,
        PlanError,
        PostcheckError,
        ReportError,
        BundleError,
        SamplerError,
    ) as exc:
        print(f"rtfleet: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
