"""qjax.train.stopping.StopRequest in a process of its own (it installs signal handlers): a first signal is noted once
(its Python handler and the watcher thread both see it, and the process keeps running), one that comes while
`uninstall` has restored the wakeup fd but not yet the handlers is still noted, and a second one exits at once."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = """
import os, signal, time
from qjax.train.stopping import StopRequest

def settle():  # let the Python handler run and the watcher thread read the wakeup byte
    for _ in range(50):
        time.sleep(0.01)

def noted(signum, during_uninstall):
    stop = StopRequest().install()
    if during_uninstall:
        signal.set_wakeup_fd(stop._previous_fd)  # uninstall's first step: from here the watcher sees nothing
    os.kill(os.getpid(), signum)
    settle()
    assert stop.signal == signum, stop.signal
    stop.uninstall()

noted(signal.SIGTERM, during_uninstall=False)
print("first signal noted once", flush=True)
noted(signal.SIGINT, during_uninstall=True)
print("signal during uninstall noted", flush=True)

stop = StopRequest().install()
os.kill(os.getpid(), signal.SIGTERM)
settle()
os.kill(os.getpid(), signal.SIGTERM)
settle()
print("still running after a second signal", flush=True)
"""


def test_stop_request_notes_first_signals_and_exits_on_a_second():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines() == ["first signal noted once", "signal during uninstall noted"], out.stderr
    assert out.returncode == 143, (out.returncode, out.stderr)
    assert "stopped by SIGTERM again: exiting at once without saving" in out.stderr
