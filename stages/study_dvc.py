"""A study preset's DVC file (compare/<study>/dvc.yaml): its cells and report as stages, and, where the
preset has its own artifacts_dir (its own corpus), the tokens, dense model and initial model it trains from.
`python -m stages.compare dvcfile --params configs/compare-<study>.yaml` writes it."""
from __future__ import annotations

import os

from spes.errors import UsageError

STUDY_PREFIX = "compare-"


def study_name(params_path: str) -> str:
    """configs/compare-merge.yaml -> 'merge': where its DVC file (compare/merge/) and results go."""
    base = os.path.splitext(os.path.basename(params_path))[0]
    if not base.startswith(STUDY_PREFIX) or base == STUDY_PREFIX:
        raise UsageError(f"dvcfile: {params_path} is not a study preset (configs/{STUDY_PREFIX}<study>.yaml)")
    return base[len(STUDY_PREFIX):]


def study_dvcfile(params_path: str) -> dict:
    """The DVC stages of one study preset: the matrix of its cells, written out (a preset inherits some of
    compare.* from params.yaml, which DVC's `vars` cannot follow), each cell a run stage, then the report;
    the layout of compare/dvc.yaml, with the preset's file as a params dependency beside params.yaml's."""
    from spes.config.loader import load_params
    from spes.eval.compare import check_matrix, has_frontier

    p = load_params(params_path)
    resolved = check_matrix(p)  # every variant checked, once
    preset = params_path.replace(os.sep, "/")
    out = f"artifacts/{STUDY_PREFIX}{study_name(params_path)}"
    c = p.compare
    run_params = [{preset: []}, {"params.yaml": ["model", "sync", "train", "outer", "merge", "data", "eval"]}]
    report_outs = ["report.md", "report.csv", "pairs.csv", "heldout_curves.csv", "heldout_curves.svg"]
    if has_frontier(resolved):
        report_outs.append("frontier.svg")
    data = p.artifacts_dir.rstrip("/")
    return {
        "stages": {
            **(_data_stages(preset, data) if data != MAIN_ARTIFACTS else {}),
            "run": {
                "matrix": {"variant": list(c.variants), "seed": list(c.seeds), "lr": list(c.lrs),
                           "budget": list(c.budgets)},
                "wdir": "../..",
                "cmd": f"python -m stages.compare run --params {preset} --variant ${{item.variant}} --seed "
                       f"${{item.seed}} --lr ${{item.lr}} --budget ${{item.budget}} --out {out}/runs/${{key}}",
                "deps": ["stages/compare.py", "stages/rounds.py", "spes", "pipelines", f"{data}/tokens",
                         f"{data}/init"],
                "params": run_params,
                "outs": [{f"{out}/runs/${{key}}/result.json": {"cache": False}}]},
            "report": {
                "wdir": "../..",
                "cmd": f"python -m stages.compare report --params {preset} --dir {out}",
                "deps": ["stages/compare.py", "spes/eval/compare.py", f"{out}/runs"],
                "params": [{preset: []}],
                "outs": [{f"{out}/{name}": {"cache": False}} for name in report_outs]}},
        "plots": [{"heldout loss vs tokens": {"template": "compare_lines", "x": "tokens",
                                              "y": {f"../../{out}/heldout_curves.csv": "heldout_loss"}}}]}


MAIN_ARTIFACTS = "artifacts"
"""The main pipeline's artifacts_dir: a study whose preset names another makes its own tokens, dense model
and initial model there (its own corpus), by the main pipeline's stages run on the preset."""


def _data_stages(preset: str, data: str) -> dict:
    def stage(name: str, deps: list[str], out: str, numbers: str = "") -> dict:
        figures = {"outs": [{f"{data}/{numbers}/timings.json": {"cache": False}}],  # as dvc.yaml's stages
                   "metrics": [{f"{data}/{numbers}/metrics.json": {"cache": False}}]} if numbers else {"outs": []}
        return {"wdir": "../..", "cmd": f"python -m stages.{name} --params {preset}", "deps": [f"stages/{name}.py", *deps],
                "params": [{preset: []}, {"params.yaml": ["tokenize", "model", "dense", "init", "data", "eval"]}],
                **figures, "outs": [f"{data}/{out}", *figures["outs"]]}

    return {"tokenize": stage("tokenize", ["spes/data"], "tokens", "tokenize"),
            "dense": stage("dense", ["spes/model", "spes/train", f"{data}/tokens"], "dense/hf", "dense"),
            "upcycle": stage("upcycle", ["spes/model", f"{data}/dense/hf", f"{data}/tokens"], "init")}


def write_dvcfile(a) -> None:
    import yaml

    body = yaml.safe_dump(study_dvcfile(a.params), sort_keys=False, width=1000)
    path = os.path.join("compare", study_name(a.params), "dvc.yaml")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(f"# Made by `python -m stages.compare dvcfile --params {a.params}`: do not edit, regenerate.\n"
                f"# `dvc repro {path}` runs this study's cells and report (see {a.params}).\n" + body)
    print(f"compare: wrote {path}")
