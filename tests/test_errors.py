"""Every error raised on purpose is a SpesError (spes/errors.py), so an entry point can name it in one line;
a bare builtin raise would end a stage with a traceback instead."""
import ast
import os

import spes.errors as errors
from tests.test_layers import ROOT, _modules

BUILTINS = {"ValueError", "RuntimeError", "TypeError", "KeyError", "Exception", "OSError"}  # AssertionError: "unreachable"


def _raised_builtins(path: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Raise) and node.exc is not None:
            call = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(call, ast.Name) and call.id in BUILTINS:
                out.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} raise {call.id}")
    return out


def test_no_bare_builtin_raise_in_the_project():
    found = [hit for path in _modules().values() for hit in _raised_builtins(path)]
    assert found == []


def test_every_error_class_is_under_the_root():
    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, BaseException)]
    assert classes and all(issubclass(c, errors.SpesError) for c in classes)
