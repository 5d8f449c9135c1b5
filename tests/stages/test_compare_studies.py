"""Each study preset (configs/compare-<study>.yaml) has its DVC file, compare/<study>/dvc.yaml, exactly as
`python -m stages.compare dvcfile` makes it from the preset: `dvc repro compare/<study>/dvc.yaml` reproduces
the study, and a changed preset without a regenerated file fails here."""
import glob
import os
import subprocess
import sys

import pytest
import yaml

from spes.errors import ModelError, UsageError
from stages.study_dvc import dvcfile_of, study_dvcfile, study_name
from tests.conftest import ROOT

PRESETS = sorted(os.path.relpath(f, ROOT) for f in glob.glob(os.path.join(ROOT, "configs", "compare-*.yaml")))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_study_has_its_dvc_file_as_generated(preset, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = os.path.join(ROOT, "compare", study_name(preset), "dvc.yaml")
    assert os.path.exists(path), f"run: python -m stages.compare dvcfile --params {preset}"
    assert yaml.safe_load(open(path)) == study_dvcfile(preset), f"regenerate: python -m stages.compare dvcfile --params {preset}"


def test_no_study_dvc_file_without_its_preset():
    studies = {os.path.basename(os.path.dirname(f)) for f in glob.glob(os.path.join(ROOT, "compare", "*", "dvc.yaml"))}
    assert studies == {study_name(p) for p in PRESETS}


def test_the_merging_study_as_dvc_stages(monkeypatch):
    monkeypatch.chdir(ROOT)
    d = study_dvcfile("configs/compare-merge.yaml")
    run, report = d["stages"]["run"], d["stages"]["report"]
    m = run["matrix"]
    assert len(m["variant"]) * len(m["seed"]) * len(m["lr"]) * len(m["budget"]) == 36
    assert "--params configs/compare-merge.yaml" in run["cmd"] and "--out artifacts/compare-merge/runs/${key}" in run["cmd"]
    assert {"configs/compare-merge.yaml": []} in run["params"]
    outs = [next(iter(o)) for o in report["outs"]]
    assert "artifacts/compare-merge/pairs.csv" in outs and not any(o.endswith("frontier.svg") for o in outs)
    assert any(next(iter(o)).endswith("frontier.svg") for o in study_dvcfile("configs/compare-sync.yaml")["stages"]["report"]["outs"])
    listed = subprocess.run([sys.executable, "-m", "dvc", "stage", "list", "compare/merge/dvc.yaml"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    stages = [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]
    assert len(stages) == 37 and "compare/merge/dvc.yaml:run@spes-8n16e-k15-1-0.002-1" in stages


def test_a_study_on_its_own_corpus_makes_its_own_data_first(monkeypatch):
    monkeypatch.chdir(ROOT)
    d = study_dvcfile("configs/compare-once.yaml")["stages"]
    assert list(d) == ["tokenize", "dense", "upcycle", "run", "report"]
    assert d["tokenize"]["cmd"] == "python -m stages.tokenize --params configs/compare-once.yaml"
    assert d["tokenize"]["outs"][0] == "artifacts/once/tokens" and d["upcycle"]["outs"] == ["artifacts/once/init"]
    assert "artifacts/once/dense/hf" in d["upcycle"]["deps"]
    assert {"artifacts/once/tokens", "artifacts/once/init"} <= set(d["run"]["deps"])
    main = study_dvcfile("configs/compare-merge.yaml")["stages"]  # the main pipeline's data: no stages of its own
    assert "tokenize" not in main and "artifacts/tokens" in main["run"]["deps"]


def test_studies_sharing_a_corpus_make_its_data_once(tmp_path, monkeypatch):
    """DVC lets one stage make an output: a preset including another study's preset with the same artifacts_dir
    leaves the tokens, dense and initial model to that study's DVC file, and its cells depend on them."""
    monkeypatch.chdir(tmp_path)
    os.mkdir("configs")
    corpus = "tokenize: {corpus: 'python:stdlib'}\nartifacts_dir: artifacts/own\n"
    open("configs/compare-b.yaml", "w").write(f"include: {ROOT}/params.yaml\n{corpus}")
    open("configs/compare-a.yaml", "w").write("include: compare-b.yaml\ncompare: {variants: {b: []}, baseline: b}\n")
    open("configs/compare-c.yaml", "w").write("include: compare-b.yaml\nartifacts_dir: artifacts/other\n")
    first, second, third = (study_dvcfile(f"configs/compare-{s}.yaml")["stages"] for s in "bac")
    assert list(first) == ["tokenize", "dense", "upcycle", "run", "report"]
    assert list(second) == ["run", "report"] and {"artifacts/own/tokens", "artifacts/own/init"} <= set(second["run"]["deps"])
    assert "--params configs/compare-a.yaml" in second["run"]["cmd"]
    assert second["run"]["params"][:2] == [{"configs/compare-a.yaml": []}, {"configs/compare-b.yaml": []}]  # both its files
    assert third["tokenize"]["outs"][0] == "artifacts/other/tokens"  # another folder: its own data


def test_study_name_refuses_a_file_that_is_not_a_study():
    assert study_name("configs/compare-sync.yaml") == "sync"
    for bad in ("params.yaml", "configs/spes-1b.yaml", "configs/compare-.yaml"):
        with pytest.raises(UsageError, match="is not a study preset"):
            study_name(bad)


def test_a_report_missing_cells_names_the_dvc_file_that_runs_them(tmp_path, monkeypatch):
    import argparse

    from spes.errors import MissingInput
    from stages.compare import report

    monkeypatch.chdir(ROOT)
    assert dvcfile_of("params.yaml") == "compare/dvc.yaml" and dvcfile_of("configs/compare-.yaml") == "compare/dvc.yaml"
    assert dvcfile_of("configs/compare-once-16x.yaml") == "compare/once-16x/dvc.yaml"
    with pytest.raises(MissingInput, match=r"once-spes-0-0\.002-16.*run `dvc repro compare/once-16x/dvc\.yaml`"):
        report(argparse.Namespace(params="configs/compare-once-16x.yaml", dir=str(tmp_path)))


def test_a_damaged_initial_model_record_is_named_not_bypassed(tmp_path, monkeypatch):
    """A variant never takes a damaged artifacts/init/config.json for another recipe's model; a missing one
    leaves the flow to say which stage to run."""
    from spes.config.loader import load_params
    from spes.eval.compare import variant_params
    from stages.compare import _variant_init

    monkeypatch.chdir(ROOT)
    p = load_params("configs/compare-scratch.yaml")
    p.artifacts_dir = str(tmp_path)
    vp = variant_params(p, "scratch-spes")
    assert _variant_init(p, vp, str(tmp_path)) == str(tmp_path / "init" / "model.safetensors")
    (tmp_path / "init").mkdir()
    for damaged in ("{not json", "[1, 2]"):
        (tmp_path / "init" / "config.json").write_text(damaged)
        with pytest.raises(ModelError, match=r"init/config.json: not an initial model's config"):
            _variant_init(p, vp, str(tmp_path))
