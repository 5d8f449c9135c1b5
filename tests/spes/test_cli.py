"""Every command line ends the same way (spes/cli.py): an error raised on purpose is one line on stderr with
an exit code saying whose it is; a bug keeps its traceback; no module exits with a message of its own."""
import ast

import pytest

from spes.cli import run_command
from spes.errors import ConfigError, MissingInput, RecordError, UsageError
from tests.test_layers import _modules


def _exit(fn, capsys, **kw) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as e:
        run_command(fn, **kw)
    return e.value.code, capsys.readouterr().err.splitlines()


def _raises(err):
    def main():
        raise err

    return main


def test_each_family_is_one_line_with_its_exit_code(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["/x/stages/rounds.py"])
    assert _exit(_raises(ConfigError("sync.rounds: must be >= 1")), capsys) == (
        2, ["config error: sync.rounds: must be >= 1"])
    assert _exit(_raises(UsageError("--nodes 'a': expected node ids")), capsys) == (
        2, ["rounds: --nodes 'a': expected node ids"])
    assert _exit(_raises(MissingInput("init does not exist")), capsys) == (1, ["rounds: MissingInput: init does not exist"])
    assert _exit(_raises(RecordError("f.json: lacks 'round'")), capsys) == (1, ["rounds: RecordError: f.json: lacks 'round'"])
    assert _exit(_raises(KeyboardInterrupt("stopped")), capsys, interrupted="rounds kept") == (
        130, ["rounds: stopped; rounds kept"])
    code, err = _exit(_raises(ConfigError("x")), capsys, hint=lambda: " (a hint)")
    assert (code, err) == (2, ["config error: x (a hint)"])
    with pytest.raises(ZeroDivisionError):  # a bug: its traceback, not a line
        run_command(lambda: 1 / 0)


def test_a_package_run_with_dash_m_is_named_by_its_folder(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["/x/spes/config/__main__.py"])
    assert _exit(_raises(UsageError("u")), capsys) == (2, ["config: u"])


def test_no_module_exits_with_a_message_of_its_own():
    """`raise SystemExit("...")` prints its own line with its own wording and exit 1: every command raises a
    typed error instead and spes/cli.py says it."""
    found = []
    for mod, path in _modules().items():
        if mod == "spes.cli":
            continue
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
                    getattr(node.exc.func, "id", None) == "SystemExit":
                found.append(f"{mod}:{node.lineno}")
    assert found == []
