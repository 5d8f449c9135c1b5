"""docs/screenshots.py in a real browser: a Prefect server and TensorBoard on loopback, a short run of the
embedded default through the stages, and a picture of each page once its rendered text shows what it is for
(issue 31, item 3). Needs the Debian chromium package; skipped, with that reason, where it is not installed."""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ("prefect-flow-run", "prefect-heldout-artifact", "prefect-round-table", "prefect-round-progress",
         "tensorboard-scalars")


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("chromium") is None, reason="no chromium on PATH (apt-get install -y chromium)")
def test_the_readmes_pictures_are_taken_by_a_script(tmp_path):
    from PIL import Image

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = subprocess.run([sys.executable, os.path.join(ROOT, "docs", "screenshots.py"), "--out", str(tmp_path),
                          "--rounds", "2", "--sync-steps", "10"], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, TMPDIR=str(scratch)))
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(report["screenshots"]) == sorted(PAGES)
    for name in PAGES:
        with Image.open(tmp_path / f"{name}.png") as im:
            assert im.size == (1680, 1000), name
            assert len(im.convert("RGB").getcolors(maxcolors=1 << 16) or range(1 << 16)) > 100, name  # drawn
    assert report["screenshots"]["prefect-round-progress"]["shows"] == "local steps done"
    assert list(scratch.iterdir()) == []  # its servers' homes, the run's storage: removed
