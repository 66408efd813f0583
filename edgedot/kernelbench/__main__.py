"""``python -m edgedot.kernelbench``: see :func:`edgedot.kernelbench.main`.

``--export PATH`` names the file to write. A PATH that is an existing directory, or that lies
below an existing file, is a usage error naming ``--export`` (exit status 2) before anything is
written; to export into a directory, name the file in it (e.g. ``DIR/model_new.py``).
"""

import argparse
import sys
from pathlib import Path

from . import main

PROG = "python -m edgedot.kernelbench"


def export_path(text):
    """``--export``: the path of a file that can be written (its folders are created)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text} is a directory: give the path of the file to write, e.g. {path / 'model_new.py'}")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise argparse.ArgumentTypeError(f"{text} lies below {parent}, which is not a directory")
            break
    return path


class _PathParser(argparse.ArgumentParser):
    """Reads some of ``main``'s options only: its usage line would be partial, so an error
    points to ``--help`` instead."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def check_args(argv):
    """Usage errors :func:`edgedot.kernelbench.main` would otherwise meet as tracebacks. Reads
    only the options that take a path, as ``main`` parses them; leaves the rest (``--help``
    included) to ``main``."""
    parser = _PathParser(prog=PROG, add_help=False)
    parser.add_argument("--export", metavar="PATH", type=export_path)
    parser.add_argument("--evaluate", metavar="PATH")  # so that abbreviations resolve as in main
    parser.add_argument("--precision", action="append")
    parser.parse_known_args(argv)


if __name__ == "__main__":
    check_args(sys.argv[1:])
    main()
