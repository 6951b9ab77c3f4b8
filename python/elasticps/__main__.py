"""The ``elasticps`` command: ``elasticps launch --workers 2 -- python train.py``, and
every other subcommand (``scheduler``, ``server``, ``train``, ``bench``, ...).

It is the program of the ``elasticps`` binary, linked into the native module, so that
``pip install`` gives the command. ``python -m elasticps`` is the same. The nodes a launcher
starts (scheduler, servers, workers) are ``python -m elasticps ROLE ...`` in turn.
"""

from __future__ import annotations

import signal
import sys


def main() -> None:
    """Runs ``elasticps`` with this process's arguments and exits with its status."""
    # As in the binary: a command that listens for Ctrl-C (launch, train) stops its nodes
    # first; any other dies of it. Python's own handler would only set a flag that nobody
    # reads while the command runs.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    from ._native import cli_main

    sys.exit(cli_main(["elasticps", *sys.argv[1:]], [sys.executable, "-m", "elasticps"]))


if __name__ == "__main__":
    main()
