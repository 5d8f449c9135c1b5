"""Numbers as a person reads them in the Prefect UI."""
import math

from pipelines.formatting import fmt_balance, fmt_bytes, fmt_loss, fmt_seconds, load_balance


def test_bytes_seconds_losses():
    assert fmt_bytes(7883626) == "7.88 MB" and fmt_bytes(11028213) == "11 MB" and fmt_bytes(2.5e9) == "2.5 GB"
    assert fmt_bytes(512) == "512 B" and fmt_bytes(1536) == "1.54 kB" and fmt_bytes(None) == "-"
    assert fmt_seconds(8.912) == "8.91 s" and fmt_seconds(125) == "2 min 05 s" and fmt_seconds(7322) == "2 h 02 min"
    assert fmt_loss(4.265827) == "4.266" and fmt_loss(float("nan")) == "-" and fmt_loss(None) == "-"


def test_expert_load_balance_per_layer():
    counts = [[10, 10, 10, 10], [40, 0, 0, 0], [0, 0, 0, 0]]
    b = load_balance(counts)
    assert b[:2] == [1.0, 4.0] and math.isnan(b[2])
    assert fmt_balance(counts[:2]) == "L0 1.00 · L1 4.00" and fmt_balance([]) == "-"  # labelled by layer


def test_sparkline_and_expert_load_heatmap():
    from pipelines.formatting import load_heatmap, sparkline

    assert sparkline([5.2, 5.0, 4.7, 4.5, 4.4, 4.35, 4.3]) == "█▇▄▂▁▁▁" and sparkline([]) == ""
    assert sparkline([1.0, 1.0]) == "▁▁"
    md = load_heatmap({0: [[10, 20, 30, 40]], 1: [[25, 25, 25, 25]]})
    assert md.splitlines() == ["layer 0:", "```",
                               "expert | 0 1 2 3|   e0   e1   e2   e3  (% of the node's routed rows)",
                               "node 0 |░░▒▒▓▓██| 10.0 20.0 30.0 40.0",
                               "node 1 |████████| 25.0 25.0 25.0 25.0", "```"]
    assert load_heatmap({}) == "no expert load recorded"


def test_expert_lists_as_ranges():
    from pipelines.formatting import fmt_experts

    assert fmt_experts([5, 0, 1, 2]) == "0-2, 5" and fmt_experts([3]) == "3" and fmt_experts([]) == "none"
