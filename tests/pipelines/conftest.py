"""Fixtures shared by the tests of several machines (test_many_machines: machines on loopback and over slow links)."""
import contextlib
import os

import pytest

from bench.cleanup import stop_process_group
from pipelines.prefect_api import free_port
from tests.conftest import prefect_home
from tests.pipelines.test_deployment import start_prefect_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def services(root, endpoint: str, tiny_tokens: str, prefect_db: str, creds: dict):
    """A Prefect server and the environment of each 'machine' (`creds`: the S3 keys every machine has unless
    its own are given), beside the S3 server at `endpoint`."""
    api = f"http://127.0.0.1:{free_port()}/api"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "AWS_", "SPES_"))}
    base.update(creds, PYTHONPATH=ROOT, PREFECT_API_URL=api, PREFECT_SERVER_ANALYTICS_ENABLED="false",
                PREFECT_UI_ENABLED="false")
    procs = []
    server_env = dict(base, PREFECT_HOME=prefect_home(root / "server-home", prefect_db))
    log = open(root / "server.log", "w")
    try:
        start_prefect_server(api, server_env, log, procs)
        # the orchestrator's folder: the token shards (it publishes them to S3) and its params; nodes have nothing
        orch = root / "orchestrator"
        (orch / "artifacts").mkdir(parents=True)
        os.symlink(tiny_tokens, orch / "artifacts" / "tokens")

        def machine_env(name: str, **own) -> dict:
            home = root / name
            home.mkdir(exist_ok=True)
            return dict(base, HOME=str(home), PREFECT_HOME=str(home / ".prefect"), **own)

        yield {"root": root, "endpoint": endpoint, "api": api, "orch": orch, "env": machine_env}
    finally:
        for p in procs:
            if p.poll() is None:
                stop_process_group(p, 10)
        log.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_tokens, prefect_db):
    """A moto S3 server (one key for all), a Prefect server, and the environment of each 'machine'."""
    from moto.server import ThreadedMotoServer

    root = tmp_path_factory.mktemp("many")
    s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    s3.start()
    host, port = s3.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing")
    if not fs.exists("spes-many"):  # moto's state is per process: another module's server made it already
        fs.mkdir("spes-many")
    try:
        with services(root, endpoint, tiny_tokens, prefect_db, CREDS) as c:
            yield c
    finally:
        s3.stop()
