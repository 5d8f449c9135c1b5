"""A Prefect server that requires an auth string (PREFECT_SERVER_API_AUTH_STRING), as the many-machines page
starts it over the internet: a stage with the right PREFECT_API_AUTH_STRING runs to the uninterrupted result;
one without it, or with another, is refused in one line naming the setting, before anything is written."""
import os
import subprocess

import pytest

from pipelines.prefect_api import check_api_access, free_port
from spes.errors import OrchestrationError
from tests.conftest import prefect_home
from tests.faults.test_stage_faults import _tree_digest, global_sha, project, reference, stage  # noqa: F401
from tests.pipelines.test_deployment import start_prefect_server

SECRET = "spes:not-a-real-secret"


@pytest.fixture(scope="module")
def protected_api(tmp_path_factory, prefect_db):
    from bench.cleanup import stop_process_group

    root = tmp_path_factory.mktemp("auth")
    api, procs = f"http://127.0.0.1:{free_port()}/api", []
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=prefect_home(root / "server-home", prefect_db), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_UI_ENABLED="false", PREFECT_SERVER_API_AUTH_STRING=SECRET)
    try:
        start_prefect_server(api, env, subprocess.DEVNULL, procs)  # its health probe is open without the string
        yield api
    finally:
        for proc in procs:
            stop_process_group(proc, 10)


def test_the_api_check_names_the_missing_or_wrong_auth_string(protected_api, monkeypatch):
    monkeypatch.delenv("PREFECT_API_AUTH_STRING", raising=False)
    with pytest.raises(OrchestrationError, match=r"answered 401 Unauthorized: the server requires an auth string; "
                                                 r"set PREFECT_API_AUTH_STRING on this machine"):
        check_api_access(protected_api)
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "spes:wrong")
    with pytest.raises(OrchestrationError, match="it refused this machine's PREFECT_API_AUTH_STRING"):
        check_api_access(protected_api)
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", SECRET)
    check_api_access(protected_api)
    with pytest.raises(OrchestrationError, match="does not answer"):
        check_api_access(f"http://127.0.0.1:{free_port()}/api")


@pytest.mark.slow
def test_a_stage_against_a_protected_server_runs_with_the_string_and_is_refused_without(  # noqa: F811
        project, reference, protected_api):  # noqa: F811  (the stage-fault tests' tiny project and reference)
    before = _tree_digest(project / "storage")
    refused = stage(project, "stages.rounds", "warmup", "orchestration.run_name=authless",
                    env_extra={"PREFECT_API_URL": protected_api}, timeout=300)
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 1 and len(lines) == 1, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert lines[0].startswith("rounds: OrchestrationError: the Prefect API at") and "PREFECT_API_AUTH_STRING" in lines[0]
    assert _tree_digest(project / "storage") == before  # nothing written: no lease, no round 0
    ok = stage(project, "stages.rounds", "warmup", "orchestration.run_name=authed",
               env_extra={"PREFECT_API_URL": protected_api, "PREFECT_API_AUTH_STRING": SECRET}, timeout=600)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert global_sha(project, "authed", 2) == reference
