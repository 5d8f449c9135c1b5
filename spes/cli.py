"""How every command line of the project ends: the stages, the node host, the served deployments, the
planner, the members tool and the params checker all run their `main` through `run_command`.

An error raised on purpose (a SpesError: bad settings or arguments, a damaged file, storage that does not
answer, the round protocol) ends the command with one line naming the problem and the error's kind, not a
traceback: exit 2 for settings and arguments (ConfigError, UsageError), 1 for the rest. Ctrl-C or SIGTERM
(turned into KeyboardInterrupt by pipelines.stopping) ends it with 130 after the caller's own cleanup ran.
A bug (any other exception) keeps its traceback: that is what a bug report needs.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Optional

from spes.errors import ConfigError, SpesError, UsageError


def command_name() -> str:
    """`stages.rounds` for `python -m stages.rounds`, the script's name otherwise."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else "command"
    name = os.path.basename(argv0).removesuffix(".py")
    if name == "__main__":  # `python -m package.module`: the module's path names it
        name = os.path.basename(os.path.dirname(argv0))
    return name


def run_command(main: Callable[[], None], hint: Callable[[], str] = lambda: "",
                interrupted: Optional[str] = None) -> None:
    """main(), its purposeful errors as one line on stderr and an exit code. `hint`: words added to a settings
    error (e.g. what `dvc exp run` did to params.yaml); `interrupted`: what a stopped command says it kept."""
    name = command_name()
    try:
        main()
    except ConfigError as e:
        print(f"config error: {e}{hint()}", file=sys.stderr)
        raise SystemExit(2) from None
    except UsageError as e:
        print(f"{name}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except SpesError as e:
        print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt as e:
        print(f"{name}: {e or 'interrupted'}" + (f"; {interrupted}" if interrupted else ""), file=sys.stderr)
        raise SystemExit(130) from None
