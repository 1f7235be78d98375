"""What a restart in place keeps and lets go, in a real child process that execs itself."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

CHILD = textwrap.dedent("""
    import json, os, socket, subprocess, sys
    from elastic.cluster.links.restart_in_place import restart_in_place
    if os.environ.get("RESTARTED"):
        links = []
        for name in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{name}"))
            except OSError:
                pass  # the listing's own descriptor, closed by now
        print(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:],
                          "sockets": [link for link in links if link.startswith("socket:")]}))
        sys.exit(0)
    os.environ["RESTARTED"] = "1"
    leaked = socket.socket()  # made inheritable, as gloo's sockets are
    leaked.set_inheritable(True)
    child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    with open(os.environ["CHILD_PID_FILE"], "w") as out:
        out.write(str(child.pid))
    print(json.dumps({"pid": os.getpid(), "leaked": leaked.fileno()}), flush=True)
    restart_in_place()
""")


def test_a_restart_in_place_keeps_pid_and_command_and_ends_children_and_inherited_sockets(
        tmp_path):
    child_pid_file = tmp_path / "child.pid"
    env = dict(os.environ, CHILD_PID_FILE=str(child_pid_file), PYTHONPATH=os.getcwd())
    done = subprocess.run([sys.executable, "-c", CHILD, "--flag", "value"], env=env,
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    before, after = (json.loads(line) for line in done.stdout.splitlines())
    assert after["pid"] == before["pid"]
    assert after["argv"] == ["--flag", "value"]
    assert after["sockets"] == []
    assert not os.path.exists(f"/proc/{int(child_pid_file.read_text())}")
    assert "Traceback" not in done.stderr
