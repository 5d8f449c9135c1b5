"""`python -m spes.policy`: the printed policy is the access module's for the params' bucket, prefix and run;
bad arguments are one line."""
import json
import subprocess
import sys

import pytest

from spes.errors import ConfigError, UsageError
from spes.policy import main
from spes.run.access import iam_policy, node_grants, orchestrator_grants
from spes.run.layout import RunLayout
from tests.conftest import ROOT


def test_prints_each_roles_policy_for_the_params_storage(capsys):
    main(["node", "--nodes", "2,0", "--run", "r1", "--url", "s3://bkt/team"])
    assert json.loads(capsys.readouterr().out) == iam_policy(node_grants(RunLayout("r1"), [0, 2]), "bkt", "team")
    main(["orchestrator", "--run", "r1", "--url", "s3://bkt"])
    assert json.loads(capsys.readouterr().out) == iam_policy(orchestrator_grants(RunLayout("r1")), "bkt", "")
    main(["orchestrator", "storage.url=s3://b2/p", "orchestration.run_name=r2"])  # params.yaml with overrides
    assert json.loads(capsys.readouterr().out)["Statement"][1]["Resource"] == [
        "arn:aws:s3:::b2/p/runs/r2/*", "arn:aws:s3:::b2/p/data/tokens/*"]


def test_bad_arguments_are_one_line():
    with pytest.raises(UsageError, match="node needs --nodes"):
        main(["node", "--url", "s3://bkt"])
    with pytest.raises(UsageError, match="--nodes takes node ids"):
        main(["node", "--nodes", "a,b", "--url", "s3://bkt"])
    with pytest.raises(UsageError, match="orchestrator takes no --nodes"):
        main(["orchestrator", "--nodes", "0", "--url", "s3://bkt"])
    with pytest.raises(ConfigError, match="storage.url must be s3://BUCKET"):
        main(["orchestrator"])  # params.yaml's storage is a local folder
    out = subprocess.run([sys.executable, "-m", "spes.policy", "orchestrator"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 2 and out.stdout == "" and len(out.stderr.splitlines()) == 1, out.stderr
