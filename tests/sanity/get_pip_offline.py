"""Stand-in for ansible-test's get-pip.py on a machine that reaches only the package index.

ansible-test bootstraps pip into each sanity venv with a get-pip script it downloads from
ci-files.testing.ansible.com, which this machine cannot reach. This does the same job with
Python's own ensurepip (the pip wheel bundled with the interpreter) and then lets that pip
install exactly what ansible-test asked for (``pip==24.2`` ...) from the package index.
`make sanity` puts it where ansible-test caches the script, only when none is there.
"""

import subprocess
import sys

# get-pip.py's own flags; pip itself does not know them
args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
subprocess.check_call([sys.executable, "-m", "ensurepip", "--default-pip"])
subprocess.check_call([sys.executable, "-m", "pip", "install", *args])
