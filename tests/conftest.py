"""Shared fixtures: one tiny model config, one tiny tokenized corpus per session, a real Prefect server."""
import glob
import os
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
# The workers and the processes they start share two cores: an OpenMP thread that spins while it waits
# for work takes a core from the others (measured beside a running study: the trainer and round tests took
# twice the CPU; on an otherwise idle machine the suite's time hardly changes). Set before torch loads its
# OpenMP runtime; the stage and node processes inherit it. No result depends on it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from spes.config.schema import ModelConfig  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
            num_experts=4, top_k=2, max_seq_len=64, qk_norm="full", norm_topk_prob=False)
"""OLMoE-style (q/k norm over all heads, gates not renormalized): the other style is params.yaml's default."""


def tiny_config(**changes) -> ModelConfig:
    """The tiny MoE every unit test uses (4 experts, top-2, 2 layers, GQA), with `changes` applied."""
    return ModelConfig(**{**TINY, **changes})


def tiny_params(seq_len: int = 16, **changes):
    """Params of the tiny model whose settings fit it (a Params is checked when built): every sequence
    length `seq_len`, 2 merge donors (fewer than the experts). Tests change the rest afterwards."""
    from spes.config.schema import DenseConfig, EvalConfig, MergeConfig, Params, TrainConfig

    model = tiny_config(**changes)
    donors = max(1, min(2, model.num_experts - 1))
    return Params(model=model, train=TrainConfig(seq_len=seq_len), merge=MergeConfig(top_k=donors),
                  dense=DenseConfig(seq_len=seq_len), eval=EvalConfig(seq_len=seq_len))


def pytest_collection_modifyitems(config, items):
    """End-to-end tests are the ones under tests/pipelines and tests/faults; gpu tests skip without CUDA.
    Modules with slow tests run first, then the other end-to-end ones, then the rest (each group in its
    order), so that on the xdist workers (`--dist loadfile --no-loadscope-reorder`) the many short modules fill
    in at the end instead of one long module starting last."""
    import torch

    slow, e2e, first = set(), set(), {}
    for i, item in enumerate(items):
        parts = item.path.parts
        if "pipelines" in parts or "faults" in parts:
            item.add_marker(pytest.mark.e2e)
            e2e.add(item.path)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="no CUDA device"))
        if item.get_closest_marker("slow"):
            slow.add(item.path)
        first.setdefault(item.path, i)
    items.sort(key=lambda it: (it.path not in slow, it.path not in e2e, first[it.path]))


def params_of(*overrides: str):
    """params.yaml's defaults (the schema's) with `key=value` overrides, as on a command line; validated."""
    from omegaconf import OmegaConf

    from spes.config.loader import params_from_dict, to_dict
    from spes.config.schema import Params

    return params_from_dict(OmegaConf.to_container(OmegaConf.merge(to_dict(Params()), OmegaConf.from_dotlist(list(overrides)))))


@pytest.fixture
def tiny():
    return tiny_config


def start_run(p, name: str = "r"):
    """Round 0 of run `name` on p's storage: the same seeded from-scratch model of p.model every time."""
    import torch

    from spes.model.transformer import CausalLM
    from spes.run.identity import InitModel, settings_fingerprint
    from spes.run.run import Run
    from spes.storage.store import Store

    torch.manual_seed(0)
    run = Run(Store.from_config(p.storage), name)
    run.ensure(settings_fingerprint(p), InitModel.from_state(CausalLM(p.model).canonical_state_dict(), p.model, "x"))
    return run


def json_sources() -> list[str]:
    """Real text on every machine: the stdlib json package's source."""
    return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")))


def json_documents() -> list[str]:
    return [open(f, encoding="utf-8").read() for f in json_sources()]


@pytest.fixture(scope="session")
def tiny_tokens(tmp_path_factory, worker_id) -> str:
    """One tokenized corpus for the test run, shared by the workers (BPE of 512 over the stdlib json
    sources; 2 of 5 held out). Tests read it; they copy it to change it."""
    from spes.data.tokenization import tokenize_corpus

    def make(folder):
        tokenize_corpus(json_documents(), str(folder / "tokens"), 512, None, 0.2, 0)

    return str(_made_once(tmp_path_factory, worker_id, "tiny-tokens", make) / "tokens")


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory, worker_id, tiny_tokens, prefect_server):
    """The tiny project's 3-round run (tests/pipelines/tiny_project.py), uninterrupted, once per test run
    (the first worker to need it makes it, the other reads it: it costs ~40 s of both cores): what every
    resume and fault test must reproduce bit for bit. {'weights': final weights, 'sha': {round: the
    global's sha256}}."""
    import json

    from safetensors.torch import load_file, save_file

    def make(folder):
        made = _reference_run(tmp_path_factory.mktemp("reference"), tiny_tokens)
        save_file(made["weights"], str(folder / "weights.safetensors"))
        (folder / "sha.json").write_text(json.dumps(made["sha"]))

    folder = _made_once(tmp_path_factory, worker_id, "tiny-reference", make)
    sha = json.loads((folder / "sha.json").read_text())
    return {"weights": load_file(str(folder / "weights.safetensors")), "sha": {int(r): h for r, h in sha.items()}}


def _reference_run(root, tiny_tokens) -> dict:
    from pipelines.training import spes_training
    from spes.config.loader import load_params
    from spes.run.layout import MODEL_FILE
    from spes.run.run import Run
    from spes.storage.store import Store
    from tests.pipelines.tiny_project import final_weights, init_run, make_project

    make_project(root, tiny_tokens)
    pfile = str(root / "params.yaml")
    init_run(pfile, "ref")
    assert spes_training(params_path=pfile, run_name="ref")["latest_committed"] == 3
    run = Run(Store.from_config(load_params(pfile).storage), "ref")
    sha = {r: run.store.read_manifest(run.layout.global_dir(r))["files"][MODEL_FILE]["sha256"] for r in (1, 2, 3)}
    return {"weights": final_weights(pfile, "ref"), "sha": sha}


def _shared_folder(tmp_path_factory, worker_id):
    """This pytest run's folder that every xdist worker sees (each worker's own when there are none)."""
    base = tmp_path_factory.getbasetemp()
    return base if worker_id == "master" else base.parent


def _made_once(tmp_path_factory, worker_id, name: str, make):
    """This test run's folder `name`, shared by the xdist workers: the first to need it fills it
    (`make(folder)`), the others wait for it and read it. Made under another name and renamed when
    whole, so a run stopped while making it leaves nothing a later fixture takes for done."""
    import shutil

    from filelock import FileLock

    shared = _shared_folder(tmp_path_factory, worker_id)
    done, making = shared / name, shared / f"{name}.making"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(making, ignore_errors=True)
            making.mkdir()
            make(making)
            os.rename(making, done)
    return done


@pytest.fixture(scope="session")
def prefect_db(tmp_path_factory, worker_id) -> str:
    """A Prefect database already migrated, made once per test run: a server started on a new PREFECT_HOME
    spends about 6 s of CPU creating its tables, and these tests start a dozen of them."""
    import sqlite3
    import subprocess

    def make(home):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update(PREFECT_HOME=str(home), PYTHONPATH=ROOT, PREFECT_SERVER_ANALYTICS_ENABLED="false")
        subprocess.run([sys.executable, "-c", "from pipelines.prefect_api import prefect_api\n"
                        "with prefect_api(): pass"], env=env, check=True, timeout=300)
        with sqlite3.connect(home / "prefect.db") as conn:  # everything into the one file that is copied
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    return str(_made_once(tmp_path_factory, worker_id, "prefect-template", make) / "prefect.db")


def prefect_home(path, prefect_db: str) -> str:
    """`path` made a PREFECT_HOME holding a copy of the migrated database (see prefect_db)."""
    import shutil

    os.makedirs(path, exist_ok=True)
    shutil.copyfile(prefect_db, os.path.join(path, "prefect.db"))
    return str(path)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory, prefect_db):
    """A real (temporary, SQLite) Prefect server for the flow tests: the one a stage starts without
    PREFECT_API_URL (pipelines/prefect_api.py), on a copy of the migrated database; this process's Prefect
    client points at it, the environment its subprocesses inherit does not (as with prefect_test_harness,
    which would create and migrate a database of its own each time: about 8 s of CPU more)."""
    os.environ["PREFECT_HOME"] = prefect_home(tmp_path_factory.mktemp("prefect_home"), prefect_db)
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from pipelines.prefect_api import TEMPORARY_API_ENV, prefect_api

    with prefect_api() as url, temporary_settings(updates={PREFECT_API_URL: url}):
        for key in ("PREFECT_API_URL", TEMPORARY_API_ENV):
            os.environ.pop(key)
        yield
