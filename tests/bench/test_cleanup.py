"""A benchmark killed by SIGTERM (a timeout, a CI runner) still removes its temporary folder."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("bench,args,prefix", [("tokenization.py", ["--small-mb", "1", "--large-mb", "2"], "spes-tok-bench-"),
                                               ("huge_document.py", ["--mb", "4"], "tmp")])
def test_a_killed_bench_leaves_no_temporary_folder(tmp_path, bench, args, prefix):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", bench), *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not any(p.startswith(prefix) for p in os.listdir(tmp_path)):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()[-2000:]
        time.sleep(0.05)
    time.sleep(0.5)  # inside its work
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert [p for p in os.listdir(tmp_path) if p.startswith(prefix)] == []
