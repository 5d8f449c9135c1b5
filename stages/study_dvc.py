"""A study preset's DVC file (compare/<study>/dvc.yaml): its cells and report as stages, and, where the
preset has its own artifacts_dir (its own corpus), the tokens, dense model and initial model it trains from
(or, where it includes another study's preset with the same artifacts_dir, depends on that study's).
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


def study_dvcfile_path(params_path: str) -> str:
    """configs/compare-merge.yaml -> compare/merge/dvc.yaml (refusing a file that is not a study preset)."""
    return f"compare/{study_name(params_path)}/dvc.yaml"


def dvcfile_of(params_path: str) -> str:
    """The DVC file whose stages run this preset's cells: a study preset's own, else compare/dvc.yaml."""
    try:
        return study_dvcfile_path(params_path)
    except UsageError:
        return "compare/dvc.yaml"


def study_dvcfile(params_path: str) -> dict:
    """The DVC stages of one study preset: the matrix of its cells, written out (a preset inherits some of
    compare.* from params.yaml, which DVC's `vars` cannot follow), each cell a run stage, then the report;
    the layout of compare/dvc.yaml, with the preset's file (and the study presets it includes) as params
    dependencies beside params.yaml's."""
    from spes.config.loader import load_params
    from spes.eval.compare import check_matrix, has_frontier

    p = load_params(params_path)
    resolved = check_matrix(p)  # every variant checked, once
    preset = params_path.replace(os.sep, "/")
    out = f"artifacts/{STUDY_PREFIX}{study_name(params_path)}"
    c = p.compare
    files = _preset_files(params_path)
    presets: list[dict] = [{f: []} for f in files]
    run_params = [*presets, {"params.yaml": ["model", "sync", "train", "outer", "merge", "data", "eval"]}]
    report_outs = ["report.md", "report.csv", "pairs.csv", "heldout_curves.csv", "heldout_curves.svg"]
    if has_frontier(resolved):
        report_outs.append("frontier.svg")
    data = p.artifacts_dir.rstrip("/")
    return {
        "stages": {
            **(_data_stages(preset, presets, data) if _makes_data(files, data) else {}),
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
                "params": list(presets),
                "outs": [{f"{out}/{name}": {"cache": False}} for name in report_outs]}},
        "plots": [{"heldout loss vs tokens": {"template": "compare_lines", "x": "tokens",
                                              "y": {f"../../{out}/heldout_curves.csv": "heldout_loss"}}}]}


MAIN_ARTIFACTS = "artifacts"
"""The main pipeline's artifacts_dir: a study whose preset names another makes its own tokens, dense model
and initial model there (its own corpus), by the main pipeline's stages run on the preset."""


def _preset_files(params_path: str) -> list[str]:
    """The preset and the study presets it includes, in turn (DVC paths): a change to any is a change to the
    study (params.yaml, at the bottom of every chain, is listed by the sections the stages read)."""
    import yaml

    files, path = [], params_path
    while True:
        files.append(os.path.normpath(path).replace(os.sep, "/"))
        with open(path) as f:
            include = (yaml.safe_load(f) or {}).get("include")
        if not isinstance(include, str) or not os.path.basename(include).startswith(STUDY_PREFIX):
            return files
        path = os.path.join(os.path.dirname(path), include)


def _makes_data(files: list[str], data: str) -> bool:
    """Whether this preset's DVC file makes the tokens, dense and initial model under `data` (`files`: the
    preset and the study presets it includes, `_preset_files`): not when they are the main pipeline's, nor
    when the study preset it includes names the same folder (that study's DVC file makes them, and DVC lets
    one stage make an output: this study's cells depend on them)."""
    from spes.config.loader import load_params

    if data == MAIN_ARTIFACTS:
        return False
    return len(files) == 1 or load_params(files[1]).artifacts_dir.rstrip("/") != data


def _data_stages(preset: str, presets: list[dict], data: str) -> dict:
    def stage(name: str, deps: list[str], out: str, numbers: str = "") -> dict:
        # as dvc.yaml's stages: the metrics a DVC output, invocation.json beside them neither that nor in git
        figures = {"metrics": [{f"{data}/{numbers}/metrics.json": {"cache": False}}]} if numbers else {}
        return {"wdir": "../..", "cmd": f"python -m stages.{name} --params {preset}", "deps": [f"stages/{name}.py", *deps],
                "params": [*presets, {"params.yaml": ["tokenize", "model", "dense", "init", "data", "eval"]}],
                "outs": [f"{data}/{out}"], **figures}

    return {"tokenize": stage("tokenize", ["spes/data"], "tokens", "tokenize"),
            "dense": stage("dense", ["spes/model", "spes/train", f"{data}/tokens"], "dense/hf", "dense"),
            "upcycle": stage("upcycle", ["spes/model", f"{data}/dense/hf", f"{data}/tokens"], "init")}


def write_dvcfile(a) -> None:
    import yaml

    class NoAnchors(yaml.SafeDumper):  # stages share their params entries: write each out, not as &id/*id
        def ignore_aliases(self, data) -> bool:
            return True

    body = yaml.dump(study_dvcfile(a.params), Dumper=NoAnchors, sort_keys=False, width=1000)
    path = study_dvcfile_path(a.params)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(f"# Made by `python -m stages.compare dvcfile --params {a.params}`: do not edit, regenerate.\n"
                f"# `dvc repro {path}` runs this study's cells and report (see {a.params}).\n" + body)
    print(f"compare: wrote {path}")
