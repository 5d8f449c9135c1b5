"""The one stream a node's round speaks to whoever asked for it, whatever carries it: JSON lines, one event
each,

    {"event": "log", "text": "..."}                         a line of the node's log
    {"event": "progress", "node": 0, "round": 3, ...}       spes.round.progress_line.Progress's fields
    {"event": "result", "ok": true, "meta": {...}}          the round's NodeReport: the stream's last event
    {"event": "result", "ok": false, "error": "...", "retryable": true}

The carriers: the node worker's stdout read by the process pool (a pipe), the node host's Unix socket read by
a `spes-node` flow run, the out file of a torchrun job's rank 0. Every reader decodes with `decode` and ends
with `report_of`, so a node's output reads the same way wherever it ran: the UI's progress comes from fields,
never from wording. A line that is not an event (a library printing to stdout, a rank's traceback) arrives
as a log event of that text, and a progress marker line written by the library (spes.round.progress_line)
as a progress event, so stray output can neither break the stream nor pass for a result.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from spes.errors import NodeFailed, ProtocolError, retryable
from spes.round.progress_line import Progress, parse_progress, progress_of
from spes.run.records import NodeReport

KINDS = ("log", "progress", "result")


@dataclass(frozen=True)
class NodeEvent:
    kind: str
    text: str = ""
    progress: Optional[Progress] = None
    result: Optional[dict] = None

    def line(self) -> str:
        """The event on the wire (one line, no newline)."""
        if self.kind == "progress" and self.progress is not None:
            body: dict[str, Any] = self.progress.fields()
        elif self.kind == "result":
            body = dict(self.result or {})
        else:
            body = {"text": self.text}
        return json.dumps({"event": self.kind, **body}, sort_keys=True)

    def sentence(self) -> str:
        """The event for people (what a relay logs)."""
        if self.progress is not None:
            return self.progress.sentence()
        return self.text if self.kind == "log" else f"result: {json.dumps(self.result)[:200]}"


def log_event(text: str) -> NodeEvent:
    return NodeEvent("log", text=text)


def result_event(report: Optional[NodeReport] = None, error: Optional[BaseException] = None) -> NodeEvent:
    """The round's last event: its report, or its error and whether a retry may help."""
    if error is None:
        if report is None:
            raise ProtocolError("a result event needs a report or an error")
        return NodeEvent("result", result={"ok": True, "meta": report.to_json()})
    # a node's error relayed by a middle carrier (a host, a rank job) travels on in the node's own words
    words = (error.node_error if isinstance(error, NodeFailed) else None) or f"{type(error).__name__}: {error}"
    return NodeEvent("result", result={"ok": False, "error": words, "retryable": retryable(error)})


def decode(line: str) -> NodeEvent:
    """The event on one line; a line that is not one is a log event of its text (see the module doc)."""
    line = line.rstrip("\n")
    try:
        d = json.loads(line)
    except ValueError:
        d = None
    if not isinstance(d, dict) or d.get("event") not in KINDS:
        progress = parse_progress(line)
        return NodeEvent("progress", progress=progress) if progress is not None else log_event(line)
    kind = d.pop("event")
    if kind == "log":
        return log_event(str(d.get("text", "")))
    if kind == "progress":
        progress = progress_of(d)
        return NodeEvent("progress", progress=progress) if progress is not None else log_event(line)
    if not isinstance(d.get("ok"), bool) or (d["ok"] and not isinstance(d.get("meta"), dict)):
        raise ProtocolError(f"a damaged result event: {line[:200]}")
    return NodeEvent("result", result=d)


def report_of(event: NodeEvent, node: int, r: int, where: str) -> NodeReport:
    """The NodeReport of a result event; raises NodeFailed with the node's own error and retry advice."""
    out = event.result or {}
    if not out.get("ok"):
        words = str(out.get("error", "no error given"))
        raise NodeFailed(f"node {node} round {r}: {words}", retryable=bool(out.get("retryable", True)), node_error=words)
    return NodeReport.from_json(out["meta"], where)


def relay_line(line: str, on_event: Callable[[NodeEvent], None], node: int, r: int,
               where: str) -> Optional[NodeReport]:
    """One line of a carrier: its log or progress event to `on_event` (None back), or the round's report
    when it is the result (NodeFailed when that result is the node's error)."""
    event = decode(line)
    if event.kind == "result":
        return report_of(event, node, r, where)
    on_event(event)
    return None


def read_stream(lines: Iterable[str], on_event: Callable[[NodeEvent], None], node: int, r: int,
                where: str) -> NodeReport:
    """Relay a carrier's events to `on_event` until its result; raises NodeFailed when the stream ends
    without one."""
    for line in lines:
        report = relay_line(line, on_event, node, r, where)
        if report is not None:
            return report
    raise NodeFailed(f"node {node} round {r}: {where} ended without a result")


class EventFormatter(logging.Formatter):
    """A logging formatter that writes each record as an event line (a node worker's stdout)."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        progress = parse_progress(message)
        return (NodeEvent("progress", progress=progress) if progress is not None else log_event(message)).line()
