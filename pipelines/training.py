"""Prefect flow for SPES training: a run is a sequence of sync rounds on shared storage.

  spes-training (flow)   one writer per run (lease on storage), resumes from a committed round;
                         parses and validates params once, then runs `round_task` per round (round.py)

A progress artifact for the run shows in the Prefect UI, beside each round's table.
"""

# No `from __future__ import annotations` here: Prefect's runner pickles a served flow by value, and
# its parameter annotations must resolve as objects in the child process.
import sys
from typing import Optional, Union

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.exceptions import TerminationSignal
from prefect.runtime import flow_run

from pipelines import stopping
from pipelines.executors import NodeExecutor, executor_for
from pipelines.flow_runs import FLOW_RUNS
from pipelines.formatting import load_heatmap, sparkline
from pipelines.library_logs import relay_library_logs
from pipelines.round import artifact_key, experiment_label, round_task
from spes.config.loader import load_params, to_dict
from spes.config.local_paths import check_local_paths
from spes.config.schema import check_against_model
from spes.errors import ConfigError, ProtocolError, SpesError
from spes.round.context import RoundContext
from spes.round.driver import checkpoint_due, resume_point
from spes.run.board import RunBoard, board_dir
from spes.run.identity import InitModel, fingerprinted, legacy_fingerprint, settings_fingerprint
from spes.run.lease import RunLease
from spes.run.records import RoundRecord
from spes.run.run import Run

STAGES = ("warmup", "train", "all")


def _flow_run_name() -> str:
    """'[<experiment>-]<run>-<stage>[-resume-<K>]', so resumed runs and DVC experiments stand out in the UI
    (the run name is filled in from the params file once the flow has read it, when no run_name was given)."""
    prm = flow_run.parameters
    return _flow_run_label(prm.get("run_name") or "spes", prm.get("stage", "all"), prm.get("resume_round"))


def _flow_run_label(run: str, stage: str, resume_round) -> str:
    """'[<DVC experiment>-]<run>-<stage>[-resume-<K>]'."""
    exp = experiment_label()
    name = (f"{exp}-" if exp else "") + f"{run}-{stage}"
    return name + (f"-resume-{resume_round}" if resume_round is not None else "")


def _rename_flow_run(run: str, stage: str, resume_round) -> None:
    from prefect.client.orchestration import get_client

    name = _flow_run_label(run, stage, resume_round)
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, name=name)
    except Exception as e:  # cosmetic: the run goes on under its first name
        get_run_logger().warning("could not rename the flow run to %s: %s", name, e)


@flow(name="spes-training", flow_run_name=_flow_run_name, log_prints=True)
def spes_training(params_path: str = "params.yaml", overrides: Optional[list[str]] = None, stage: str = "all",
                  resume_round: Optional[Union[int, str]] = None, run_name: Optional[str] = None,
                  init_path: Optional[str] = None, on_mismatch: str = "error") -> dict:
    """Run rounds up to the stage's last round ('warmup' -> sync.warmup_rounds, 'train'/'all' -> sync.rounds),
    continuing after the latest committed round, or after round `resume_round` (later ones are set aside)."""
    relay_library_logs()
    if stage not in STAGES:
        raise ConfigError(f"stage must be one of {STAGES}, got {stage!r}")
    p = load_params(params_path, list(overrides or []) + ([f"orchestration.run_name={run_name}"] if run_name else []))
    executor = executor_for(p)
    check_local_paths(p, executor.nodes_here)  # a deployment run reads its settings here: before the lease
    run = p.orchestration.run_name
    if not run_name:
        _rename_flow_run(run, stage, resume_round)
    ctx = FLOW_RUNS.open(p, run, executor).ctx
    executor.prepare(ctx)  # before the lease and any round
    if resume_round is not None and ctx.run.info() is None and not ctx.run.committed_rounds():
        raise ProtocolError(f"resume_round={resume_round}: run {run!r} has nothing to resume on "
                            f"{ctx.store.location}; a run started with overrides (storage, model, nodes) resumes "
                            "with the same ones: --param 'overrides=[\"storage.url=...\", ...]' (docs/operating.md)")
    with RunLease(ctx.store, run, p.orchestration.lock_ttl_s) as lease:
        ctx.run.forget_globals()  # what was read before the lease may have been moved aside by another writer since
        try:
            return _run_rounds(ctx, executor, lease, stage, resume_round, init_path, on_mismatch)
        except SpesError as e:
            lease.explain(e)  # a failure after the lease was lost says so
            raise
        except TerminationSignal:
            _stop_what_is_in_flight("SIGTERM")
            raise
        finally:
            executor.close()
            FLOW_RUNS.close()


def _stop_what_is_in_flight(why: str) -> None:
    """While a flow runs, Prefect owns the SIGTERM handler (its TerminationSignal replaces the stage's own,
    pipelines/stopping.py): cancel the node work in flight here too, so the orchestrator ends within seconds,
    not when the rounds on other machines end."""
    if stopping.STOPPING.is_set():
        return  # the stage's own handler did it
    cancelled = stopping.cancel_in_flight()
    get_run_logger().warning("%s: stopping; cancelled %s", why, ", ".join(cancelled) or "no node flow run")


def _round_bar(run: str, stage: str, first: int, last: int):
    """A tqdm bar of the stage's rounds on a terminal (None elsewhere: logs and the Prefect UI say the same)."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=last, initial=first - 1, unit="round", desc=f"{run} {stage}", dynamic_ncols=True)


def _svg_image(series: dict, title: str, ylabel: str) -> str:
    """A markdown image of an SVG line plot as a data URI: the Prefect UI (3.9, checked in headless Chromium)
    renders it inside a markdown artifact, with nothing to host."""
    import base64

    from spes.eval.svg_plot import line_plot_svg

    svg = line_plot_svg(series, title, "training tokens", ylabel, "no points yet")
    return f"![{title}](data:image/svg+xml;base64,{base64.b64encode(svg.encode()).decode()})"


def _heldout_markdown(curve: "HeldOutCurve") -> str:
    points = curve.points
    lines = ["| round | tokens so far | held-out loss |", "|---|---|---|"]
    lines += [f"| {r} | {tokens:,} | {loss:.4f} |" for r, tokens, loss in points]
    losses = [loss for _, _, loss in points]
    picture = f"`{sparkline(losses)}` {losses[0]:.4f} → {losses[-1]:.4f}" if losses else ""
    held = _svg_image({"held-out loss": [(t, v) for _, t, v in points]}, "held-out loss of the committed global",
                      "held-out loss")
    nodes = _svg_image({f"node {n}": pts for n, pts in sorted(curve.node_points.items())},
                       "train loss per node (mean of each round's steps)", "train loss")
    return (f"Held-out loss of the committed global ({len(points)} rounds)\n\n{picture}\n\n{held}\n\n{nodes}\n\n"
            + "\n".join(lines))


class HeldOutCurve:
    """(round, tokens so far, held-out loss) of the run, kept in the flow: the records of earlier rounds are
    read once when the flow starts, then each round adds its own (no per-round rescan of storage)."""

    def __init__(self, run: Run, first: int):
        self.points: list[tuple[int, int, float]] = []
        self.node_points: dict[int, list[tuple[int, float]]] = {}
        """node -> (tokens so far, its mean train loss of the round), each round it trained."""
        self.tokens = 0
        self.earlier = run.records(1, first - 1)
        """The records read once at the flow's start (the TensorBoard writer continues from them too)."""
        for rec in self.earlier:
            self.add(rec)

    def add(self, rec: RoundRecord) -> bool:
        self.tokens += rec.tokens
        for node, loss in sorted(rec.aggregate.node_loss.items()):
            self.node_points.setdefault(node, []).append((self.tokens, loss))
        if rec.heldout_loss is None:
            return False
        self.points.append((rec.round, self.tokens, rec.heldout_loss))
        return True


def _run_rounds(ctx: RoundContext, executor: NodeExecutor, lease: RunLease, stage: str, resume_round, init_path,
                on_mismatch) -> dict:
    """The flow's body, run while it holds the run's writer lease."""
    logger = get_run_logger()
    p, run = ctx.p, ctx.run
    executor.start(ctx)
    on_mismatch = "restart" if p.orchestration.supersede else on_mismatch
    init = InitModel.load(init_path) if init_path else None
    if init is not None:  # before round 0 is written from it
        check_against_model(p, init.model_config, init_path)
    run.ensure(settings_fingerprint(p), init, on_mismatch,
               legacy=legacy_fingerprint(p), fresh=p.orchestration.fresh and stage != "train",
               settings=fingerprinted(to_dict(p)))
    # a damaged latest round is set aside (not a dead end); an extended wsd run keeps its stable rounds
    first = resume_point(p, run, resume_round, executor.local_state_checker(ctx))
    run.prune_superseded(p.storage.keep_superseded)
    start_meta = run.check_global(first - 1)
    check_against_model(p, start_meta.model_config, f"{run.store.url}/{run.layout.global_dir(first - 1)}")
    last = p.sync.warmup_rounds if stage == "warmup" else p.sync.rounds
    if first > last:  # e.g. resume_round=latest on a finished run: say so rather than "starting at round 11"
        logger.info("run %s: nothing to do: rounds 1-%d of the %s stage are committed (round %d is the latest)",
                    run.name, last, stage, first - 1)
    else:
        logger.info("run %s: starting at round %d of %d", run.name, first, last)
    tokens_key = executor.share_tokens(ctx) if first <= last else None
    progress = create_progress_artifact(progress=100.0 * (first - 1) / p.sync.rounds,
                                        key=artifact_key(run.name, "progress"),
                                        description=f"rounds committed of {p.sync.rounds}")
    curve = HeldOutCurve(run, first)
    board = RunBoard(p, run.name, curve.earlier) if board_dir(p, run.name) and first <= last else None
    rounds = []
    bar = _round_bar(run.name, stage, first, last)
    for r in range(first, last + 1):
        lease.check()  # never start a round (and write to the run) without the lease
        rec = round_task.with_options(task_run_name=f"round-{r}")(p, run.name, r, checkpoint_due(p, r, last),
                                                                  tokens_key)
        rounds.append(rec.round)
        logger.info("round %d committed: contributors %s, held-out loss %s, wall %.1fs",
                    r, rec.aggregate.contributors, rec.heldout_loss, rec.wall_s)
        update_progress_artifact(progress, 100.0 * r / p.sync.rounds)
        if bar is not None:
            bar.set_postfix(heldout=f"{rec.heldout_loss:.4f}" if rec.heldout_loss is not None else "-")
            bar.update(1)
        if board is not None:
            board.add(rec)
        if curve.add(rec):
            create_markdown_artifact(_heldout_markdown(curve), key=artifact_key(run.name, "heldout"),
                                     description=f"held-out loss per round, up to round {r}")
    if rounds:  # the expert load of the stage's last round, per layer and node
        load = {n.node: n.upload.expert_load for n in rec.nodes if n.ok and n.upload.expert_load}
        create_markdown_artifact(f"Expert load in round {rec.round} (share of each node's routed rows per expert)"
                                 f"\n\n{load_heatmap(load)}", key=artifact_key(run.name, "expert-load"),
                                 description=f"expert load per layer, nodes x experts, round {rec.round}")
    if bar is not None:
        bar.close()
    if board is not None:
        board.close()
    latest = run.latest_round()
    return {"run": run.name, "first_round": first, "last_round": max(last, first - 1), "rounds_run": rounds,
            "latest_committed": latest}
