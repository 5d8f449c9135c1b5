"""The comparison report in the Prefect UI: a markdown artifact `compare-report` (stages/compare.py)."""

# No `from __future__ import annotations`: see pipelines/training.py.
from prefect import flow
from prefect.artifacts import create_markdown_artifact


@flow(name="spes-compare-report", flow_run_name="compare-report")
def publish_report(markdown: str) -> None:
    create_markdown_artifact(markdown, key="compare-report", description="SPES vs baselines at equal tokens")
