#!/bin/bash
# The collection as a user gets it (make collection): from an empty directory outside the
# checkout, install the built rtfleet.fleet tarball, list its modules and roles with
# ansible-doc, and run `ansible-playbook -i <their inventory> rtfleet.fleet.assess` against a
# lab host booted for the purpose, with an inventory and ansible.cfg of that directory's own.
# Also syntax-checks rtfleet.fleet.site there, and runs the README's verify suite
# (tests/infra) from the installed copy in a clean venv with only requirements.txt: it
# collects, and its host-free tests pass. Uses the checkout only to build the tarball and to
# boot the lab host (`rtfleet lab`, its own state directory).
#
# COLLECTION_TOPOLOGY picks the lab host (default epyc-2ccx: 8 vCPUs, 2 NUMA nodes, 2 L3
# groups); COLLECTION_KEEP=1 keeps the directory for a look afterwards.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
bin=$repo/.venv/bin
topology=${COLLECTION_TOPOLOGY:-epyc-2ccx}
work=$(mktemp -d /tmp/rtfleet-collection.XXXXXX)
export RTFLEET_LAB_DIR=$work/lab
# Only what a user's shell has: no ANSIBLE_CONFIG pointing into the checkout.
unset ANSIBLE_CONFIG ANSIBLE_COLLECTIONS_PATH ANSIBLE_ROLES_PATH

cleanup() {
    "$bin/rtfleet" lab down --all >/dev/null 2>&1 || true
    if [ "${COLLECTION_KEEP:-0}" = 1 ]; then echo "kept $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT

fail() { echo "collection check: $*" >&2; exit 1; }

"$bin/ansible-galaxy" collection build --output-path "$work/dist" "$repo" >/dev/null
tarball=$(ls "$work"/dist/rtfleet-fleet-*.tar.gz)
echo "built $(basename "$tarball") ($(du -k "$tarball" | cut -f1) KiB)"

mkdir "$work/user"
cd "$work/user"
cat >ansible.cfg <<'EOF'
[defaults]
collections_path = ./collections
host_key_checking = False
interpreter_python = auto_silent
EOF
# Only ./collections: not the checkout `make setup` links into the venv's site-packages
# (which ansible-galaxy would take for this collection, installed already).
export ANSIBLE_COLLECTIONS_SCAN_SYS_PATH=false
"$bin/ansible-galaxy" collection install --no-deps -p ./collections "$tarball"
# Its dependencies (galaxy.yml) as `ansible-galaxy collection install` would put them there,
# from the `ansible` package's copies: this machine cannot reach Galaxy.
site=$("$bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for dep in ansible/posix community/general kubernetes/core; do
    mkdir -p "collections/ansible_collections/${dep%/*}"
    cp -a "$site/ansible_collections/$dep" "collections/ansible_collections/$dep"
done
"$bin/ansible-galaxy" collection list

modules=$("$bin/ansible-doc" -l rtfleet.fleet)
echo "$modules"
for m in cpu_topology bios_checklist boot_state kubelet_config fleet_report runtime_bundle; do
    grep -q "^rtfleet.fleet.$m " <<<"$modules" || fail "ansible-doc -l rtfleet.fleet does not list $m"
done
roles=$("$bin/ansible-doc" -t role -l rtfleet.fleet)
echo "$roles"
for r in rtfleet_host rtfleet_kubelet rtfleet_runtime rtfleet_postcheck; do
    grep -q "^rtfleet.fleet.$r:" <<<"$roles" || fail "ansible-doc -t role -l rtfleet.fleet does not list $r"
done
# The installed copy answers.
doc_path=$("$bin/ansible-doc" rtfleet.fleet.cpu_topology | head -1)
grep -q "$work/user/collections/ansible_collections/rtfleet/fleet/" <<<"$doc_path" \
    || fail "rtfleet.fleet.cpu_topology resolves outside ./collections: $doc_path"

# The README's verify step from the installed copy, in a clean Python that has only the
# collection's requirements.txt (the README's install step; not the checkout's venv, not
# the rtfleet package): the testinfra suite collects, and its host-free tests pass.
installed=$work/user/collections/ansible_collections/rtfleet/fleet
python3 -m venv "$work/verify-venv"
"$work/verify-venv/bin/python" -m pip install --quiet -r "$installed/requirements.txt"
verify=("$work/verify-venv/bin/python" -m pytest "$installed/tests/infra" -p no:cacheprovider)
"${verify[@]}" --collect-only -q >verify-collect.log 2>&1 \
    || { cat verify-collect.log; fail "tests/infra does not collect from the installed collection"; }
tail -1 verify-collect.log
"${verify[@]}" -m hostfree -q || fail "tests/infra's host-free tests fail from the installed collection"

"$bin/rtfleet" lab up "coll1=$topology"
# Their inventory: one node, by address, port, user and key, as any inventory has them.
"$bin/python" - "$RTFLEET_LAB_DIR/inventory.yml" >inventory.yml <<'EOF'
import sys

import yaml

lab = yaml.safe_load(open(sys.argv[1]))["all"]["children"]["lab"]["hosts"]
keep = ("ansible_host", "ansible_port", "ansible_user", "ansible_ssh_private_key_file",
        "ansible_ssh_common_args")
hosts = {name: {k: v for k, v in host.items() if k in keep} for name, host in lab.items()}
doc = {"inference_nodes": {"hosts": hosts, "vars": {"rtfleet_host_allow_virtual": True}}}
print("---")
print(yaml.safe_dump(doc, sort_keys=False, default_flow_style=False), end="")
EOF
cat inventory.yml

"$bin/ansible-playbook" -i inventory.yml --syntax-check rtfleet.fleet.site
"$bin/ansible-playbook" -i inventory.yml rtfleet.fleet.assess | tee assess.log
grep -q "L3 groups: " assess.log || fail "rtfleet.fleet.assess showed no plan"
grep -qE "coll1 +: ok=[0-9]+ +changed=0 +unreachable=0 +failed=0" assess.log \
    || fail "rtfleet.fleet.assess did not pass cleanly on coll1 (or changed something)"
echo "collection check: installed, listed, and rtfleet.fleet.assess ran from $work/user"
