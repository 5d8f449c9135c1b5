"""One node-executor interface: the registry holds every executor the config offers, and no module besides
the registry reads the executor's name."""
import ast
import inspect

import pytest

from pipelines.executors import EXECUTORS, NodeExecutor, executor_for
from spes.config.choices import EXECUTORS as CHOICES
from spes.config.schema import OrchestrationConfig, Params
from tests.test_layers import _modules


def test_the_registry_is_the_configs_list_and_every_entry_a_node_executor():
    assert tuple(EXECUTORS) == CHOICES
    for name, cls in EXECUTORS.items():
        assert issubclass(cls, NodeExecutor) and cls.name == name and not inspect.isabstract(cls)
        assert type(executor_for(Params(orchestration=OrchestrationConfig(executor=name)))) is cls
    with pytest.raises(TypeError):
        NodeExecutor()  # an interface, not an implementation


def test_no_module_reads_the_executors_name_but_the_registry():
    readers = []
    for module, path in _modules().items():
        if module in ("pipelines.executors", "spes.config.runtime"):
            continue
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Attribute) and node.attr == "executor":
                readers.append(f"{module}:{node.lineno}")
    assert readers == []


def test_choosing_an_executor_does_not_import_prefect():
    """stages.rounds picks its executor before PREFECT_API_URL is set; Prefect imported then would read its
    settings without it and start a temporary server of its own (which outlived a killed stage)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = ("import sys, pipelines.executors as e; from spes.config.schema import Params; "
            "e.executor_for(Params()).preflight(Params()); print('prefect' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
