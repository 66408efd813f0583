"""``python -m edgedot.kernelbench``: see :func:`edgedot.kernelbench.main`."""

from . import main

main()
