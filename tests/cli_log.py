"""Reading back the training log of a run made through the CLI (``epochal log show --json``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from epochal.testing import epochal_command


def rows(folder: Path, db: str = "runs/epochal.sqlite") -> list[dict[str, Any]]:
    """The rows of the latest run in *folder*'s log *db*: ``{"iteration": i, **values}`` each."""
    shown = epochal_command("log", "show", "latest", "--db", db, "--json", cwd=folder)
    assert shown.returncode == 0, shown.stderr
    return [{"iteration": row["iteration"], **row["values"]} for row in json.loads(shown.stdout)["rows"]]
