"""A round priced over a link (spes/train/link_plan.py): the parsers, the arithmetic, the CLI's JSON line."""
import json
import math
import subprocess
import sys

import pytest

from spes.errors import ConfigError
from spes.model.names import canonical_shapes
from spes.sync.methods import sync_method
from spes.sync.traffic import largest_node_traffic
from spes.train.link_plan import link_plan, parse_duration, parse_rate, train_flops_per_token
from tests.conftest import ROOT, tiny_params


def test_rates_and_durations():
    assert parse_rate("100Mbit/s") == 1e8 and parse_rate("1Gbps") == 1e9 and parse_rate("12.5MB/s") == 1e8
    assert parse_rate("20 kbit/s") == 2e4 and parse_duration("50ms") == 0.05 and parse_duration("2s") == 2.0
    for bad in ("100", "100Mbit", "fast", "", "0Mbit/s", "-5Mbit/s", "1.2.3Gbit/s"):
        with pytest.raises(ConfigError, match="--link"):
            parse_rate(bad, "--link")
    with pytest.raises(ConfigError, match=r"--rtt: not a duration: '50'"):
        parse_duration("50", "--rtt")


def test_the_flops_of_a_token():
    p = tiny_params()
    cfg, shapes = p.model, canonical_shapes(p.model)
    experts = sum(math.prod(s) for n, s in shapes.items() if ".experts." in n)
    embed = math.prod(shapes["model.embed_tokens.weight"])
    active = sum(math.prod(s) for s in shapes.values()) - embed - experts + experts * cfg.top_k // cfg.num_experts
    want = 6 * active + 12 * cfg.num_layers * cfg.num_heads * cfg.dim_per_head * 16
    assert train_flops_per_token(cfg, 16) == want


def test_a_rounds_time_is_its_bytes_at_the_rate_plus_a_round_trip_per_file():
    p = tiny_params()
    t = largest_node_traffic(p, sync_method(p))
    plan = link_plan(p, 1, 1e6, 0.04, tflops=1e-3, mfu=0.5)
    assert plan["up_s"] == t.up_bytes * 8 / 1e6 + len(t.up) * 0.04
    assert plan["down_s"] == t.down_bytes * 8 / 1e6 + len(t.down) * 0.04
    tokens = p.train.batch_size * p.train.seq_len * p.sync.every_steps
    assert plan["compute_s"] == tokens * train_flops_per_token(p.model, p.train.seq_len) / (1e-3 * 1e12 * 0.5)
    assert plan["transfer_to_compute"] == plan["transfer_s"] / plan["compute_s"]
    assert plan["round_s_hidden"] == max(plan["compute_s"], plan["transfer_s"])
    # a storage side slower than all nodes together bounds each phase
    slow = link_plan(p, 1, 1e6, 0.04, storage_bps=1e6, tflops=1e-3, mfu=0.5)
    assert slow["up_s"] == p.sync.num_nodes * t.up_bytes * 8 / 1e6
    with pytest.raises(ConfigError, match="--mfu"):
        link_plan(p, 1, 1e6, 0.04, mfu=1.5)


def test_the_planner_prices_a_preset_over_a_link():
    res = subprocess.run([sys.executable, "-m", "spes.plan", "--params", "configs/spes-2b-16nodes.yaml", "--link",
                          "100Mbit/s", "--rtt", "50ms", "--json", "sync.codec=int8"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    link = json.loads(res.stdout.splitlines()[-1])["link"]
    assert (link["codec"], link["nodes"], link["link_bits_per_s"], link["rtt_s"]) == ("int8", 16, 1e8, 0.05)
    assert 0.35e9 < link["bytes_up_per_node_round"] < 0.45e9 and 1.8e9 < link["bytes_down_per_node_round"] < 2.2e9
    assert "transfer / compute" in res.stdout
    bad = subprocess.run([sys.executable, "-m", "spes.plan", "--link", "fast"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and bad.stderr.strip().splitlines()[-1].startswith("config error: --link: not a rate")
