"""Runs of different DVC experiments are told apart in the Prefect UI: flow-run names and artifact keys carry
the experiment's name (`DVC_EXP_NAME`, which `dvc exp run` sets)."""
from pipelines.round import artifact_key
from pipelines.training import _flow_run_label


def test_flow_run_names_and_artifact_keys_carry_the_experiment(monkeypatch):
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    assert _flow_run_label("default", "train", None) == "default-train"
    assert artifact_key("default", "round", 3) == "default-round-3"
    monkeypatch.setenv("DVC_EXP_NAME", "lucid_Bump")
    assert _flow_run_label("default", "train", 9) == "lucid_Bump-default-train-resume-9"
    assert artifact_key("default", "round", 3, "progress") == "lucid-bump-default-round-3-progress"
