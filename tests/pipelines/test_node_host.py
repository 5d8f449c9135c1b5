"""The node host's door and the node machine's command line: requests for nodes it does not hold are refused
with a reason, the node list parses, deployment names are checked up front."""
import pytest

from pipelines.deployment_nodes import node_deployment
from pipelines.node_flow import parse_nodes
from pipelines.node_host import NodeHost, host_round
from pipelines.request import NodeRequest
from spes.config.loader import params_from_dict, to_dict
from spes.config.schema import Params
from spes.errors import ConfigError, NodeFailed, UsageError


def test_a_host_refuses_a_node_it_does_not_hold():
    host = NodeHost([0, 1])
    try:
        with pytest.raises(NodeFailed, match=r"node 3 is not served by this host \(it serves \[0, 1\]\)") as e:
            host_round(host.path, NodeRequest({}, "r", 1, 3), lambda line: None)
        assert e.value.retryable is False
    finally:
        host.close()
    with pytest.raises(NodeFailed, match="no node host at"):
        host_round(host.path, NodeRequest({}, "r", 1, 0), lambda line: None)


def test_node_lists_and_deployment_names():
    assert parse_nodes("0,1") == [0, 1] and parse_nodes("0-3") == [0, 1, 2, 3] and parse_nodes("2, 0-1,2") == [0, 1, 2]
    with pytest.raises(UsageError, match="expected node ids"):
        parse_nodes("a")
    assert node_deployment("spes-node/spes-node-{node}", 3) == "spes-node/spes-node-3"
    assert node_deployment("spes-node/shared", 3) == "spes-node/shared"
    d = to_dict(Params())
    for bad in ("spes-node", "spes-node/x-{nod}", "a/b/c", "spes-node/x-{node}\n"):
        d["orchestration"]["node_deployment"] = bad
        with pytest.raises(ConfigError, match="orchestration.node_deployment must be '<flow>/<deployment>'"):
            params_from_dict(d)
    d["orchestration"]["node_deployment"], d["orchestration"]["heartbeat_timeout_s"] = "f/n-{node}", 0
    with pytest.raises(ConfigError, match="heartbeat_timeout_s must be > 0"):
        params_from_dict(d)
