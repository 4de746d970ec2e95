"""``python -m epochal``: the same as the ``epochal`` command."""

from epochal.cli import main

main()
