"""Small modules with one job each, functions that fit on a screen (issue 30, item 5; issue 47, item 7): a
module of spes/, pipelines/ or stages/ over 300 lines is flagged (a warning in the test summary: time to see
whether its concerns diverge), over 400 fails; no function over 60 lines. A module is split by concern (e.g.
spes/run/rounds.py beside spes/run/run.py), not squeezed to win a count."""
import ast
import warnings

from tests.test_layers import ROOT, _modules

FLAG_MODULE_LINES = 300
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _module_lines() -> dict[str, int]:
    return {mod: len(open(path, encoding="utf-8").read().splitlines()) for mod, path in _modules().items()}


def test_no_module_over_400_lines_and_those_over_300_are_flagged():
    lines = _module_lines()
    flagged = {mod: n for mod, n in lines.items() if FLAG_MODULE_LINES < n <= MAX_MODULE_LINES}
    if flagged:
        warnings.warn(f"modules over {FLAG_MODULE_LINES} lines (do their concerns diverge?): {flagged}", stacklevel=1)
    assert {mod: n for mod, n in lines.items() if n > MAX_MODULE_LINES} == {}


def test_no_function_over_60_lines():
    long = []
    for mod, path in _modules().items():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{mod}.{node.name}: {n} lines")
    assert long == [], ROOT


MAX_ROUND_PARAMETERS = 6


def test_no_function_of_the_round_takes_more_than_6_parameters():
    """spes/round/ reads in one sitting (issue 47, item 3): what travels together is one record (a RoundBase,
    the Contributions, a Reading, the Streams of an attempt), not a row of arguments. `self` is not counted."""
    wide = []
    for mod, path in _modules().items():
        if not mod.startswith("spes.round."):
            continue
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                n -= bool(a.args and a.args[0].arg in ("self", "cls"))
                if n > MAX_ROUND_PARAMETERS:
                    wide.append(f"{mod}.{node.name}: {n} parameters")
    assert wide == []
