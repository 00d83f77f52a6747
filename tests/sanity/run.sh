#!/bin/bash
# ansible-test sanity for the collection's modules, plugins and metadata (make sanity).
# ansible-test must run inside ansible_collections/<namespace>/<name>: this installs the
# built tarball into a scratch tree and runs there, on this Python. ansible-test bootstraps
# pip in its test venvs with a script it downloads from ci-files.testing.ansible.com; where
# that cannot be reached, get_pip_offline.py (Python's ensurepip, then the package index)
# takes its place in ansible-test's cache.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
bin=$repo/.venv/bin
work=$(mktemp -d /tmp/rtfleet-sanity.XXXXXX)
trap 'rm -rf "$work"' EXIT

# the pip version ansible-test pins for its venvs (python_requirements.py: pip='24.2')
reqs=$("$bin/python" -c 'import ansible_test._internal.python_requirements as r; print(r.__file__)')
pip_version=$(grep -oP "^\s*pip='\K[0-9.]+" "$reqs")
cache=~/.ansible/test/cache/get_pip_${pip_version//./_}.py
if [ ! -s "$cache" ] && ! curl -fsS --max-time 10 -o /dev/null https://ci-files.testing.ansible.com/ 2>/dev/null; then
    mkdir -p "$(dirname "$cache")"
    cp "$repo/tests/sanity/get_pip_offline.py" "$cache"
fi

"$bin/ansible-galaxy" collection build --output-path "$work/dist" "$repo" >/dev/null
"$bin/ansible-galaxy" collection install --force --no-deps -p "$work" "$work"/dist/rtfleet-fleet-*.tar.gz >/dev/null
cd "$work/ansible_collections/rtfleet/fleet"
# The Python code outside plugins/ (the CLI, shminfer, tests, the lab) is ruff's: ansible-test
# would hold it to module rules it does not run under.
PATH=$bin:$PATH ansible-test sanity --color no --python "$("$bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
    "$@" plugins/ meta/ changelogs/
