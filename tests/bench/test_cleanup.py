"""A benchmark killed by SIGTERM (a timeout, a CI runner) still removes its temporary folder."""
import os
import signal
import subprocess
import sys
import time

from tests.conftest import ROOT


def test_a_killed_bench_leaves_no_temporary_folder(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "tokenization.py"), "--small-mb", "1",
                             "--large-mb", "2"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not any(p.startswith("spes-tok-bench-") for p in os.listdir(tmp_path)):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()[-2000:]
        time.sleep(0.05)
    time.sleep(0.5)  # inside its work
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert [p for p in os.listdir(tmp_path) if p.startswith("spes-tok-bench-")] == []
