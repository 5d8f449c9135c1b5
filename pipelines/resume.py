"""Resume a run through the served training deployment and say, where the command was typed, how it ended.

    python -m pipelines.resume                          # resume_round=latest of params.yaml's run
    python -m pipelines.resume --round 5 --run default  # rounds after 5 are set aside and recomputed
    python -m pipelines.resume --override storage.url=s3://my-bucket/spes --override orchestration.executor=deployment

`prefect deployment run ... --watch` ends a refused or failed run with `Flow run finished in state 'Failed'`
and exit 1; the reason is only in the UI. This starts the same flow run (deployment `spes-training/spes`,
served by `python -m pipelines.serve`), follows it, and ends with the final state's message as one line:
`resume: OrchestrationError: flow run <name> ended Failed: ProtocolError: run 'default': round 9 is not
resumable ... (resumable: [0, 4, 5, 10])`, exit 1.
"""
from __future__ import annotations

import argparse
import os
import time

from spes.cli import run_command
from spes.errors import OrchestrationError, UsageError

FINAL_POLL_S = 1.0


def _round(value: str):
    if value == "latest":
        return value
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"--round must be 'latest' or a round number, got {value!r}") from None


def _final_line(state) -> str:
    """The final state's message without Prefect's preamble: the error's kind and the one-line reason."""
    message = (state.message or "").removeprefix("Flow run encountered an exception: ").strip()
    return message.splitlines()[0] if message else f"the flow run ended {state.name}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--round", default="latest", type=_round, help="'latest' (default) or a committed round")
    ap.add_argument("--run", default=None, help="the run's name (default: params.yaml's orchestration.run_name)")
    ap.add_argument("--stage", default="all", choices=("warmup", "train", "all"))
    ap.add_argument("--deployment", default="spes-training/spes")
    ap.add_argument("--override", action="append", default=[], help="key=value, as the run was started with")
    a = ap.parse_args()
    if not os.environ.get("PREFECT_API_URL"):
        raise UsageError("PREFECT_API_URL is not set: point it at the server that serves the deployment")
    from pipelines.prefect_api import check_api_access

    check_api_access(os.environ["PREFECT_API_URL"])
    from prefect.client.orchestration import get_client

    params: dict = {"resume_round": a.round, "stage": a.stage}
    if a.run:
        params["run_name"] = a.run
    if a.override:
        params["overrides"] = a.override
    with get_client(sync_client=True) as client:
        try:
            deployment = client.read_deployment_by_name(a.deployment)
        except Exception as e:  # ObjectNotFound, or the API refusing: one line
            raise OrchestrationError(f"no deployment {a.deployment!r} on {os.environ['PREFECT_API_URL']} "
                                     f"({type(e).__name__}); start it with python -m pipelines.serve") from None
        fr = client.create_flow_run_from_deployment(deployment.id, parameters=params)
        print(f"resume: flow run {fr.name} ({fr.id}) of {a.deployment}, resume_round={a.round}", flush=True)
        while True:
            state = client.read_flow_run(fr.id).state
            if state is not None and state.is_final():
                break
            time.sleep(FINAL_POLL_S)
    if not state.is_completed():
        raise OrchestrationError(f"flow run {fr.name} ended {state.name}: {_final_line(state)}")
    print(f"resume: flow run {fr.name} completed", flush=True)


if __name__ == "__main__":
    run_command(main)
