"""Everything epochal prints fits an 80-column terminal (issue 47): the hook reference, both
tables of ``epochal plugins``, paths in tables, the model line."""

from __future__ import annotations

from typing import Any

import pytest

from epochal.console import render_table
from epochal.examples.tiny import TinyModel, tiny_data
from epochal.summary import RunSummary
from epochal.testing import epochal_command, run_loop


@pytest.mark.slow
def test_the_hook_reference_and_the_plugin_listing_fit_80_columns(tmp_path: Any) -> None:
    hooks = epochal_command("hooks", cwd=tmp_path, env={"COLUMNS": "80"})
    assert hooks.returncode == 0, hooks.stderr
    assert max(map(len, hooks.stdout.splitlines())) <= 80
    said = " ".join(hooks.stdout.split())  # the words are all there, reflowed
    assert "loop.resumed is true and on_resumption() follows" in said
    piped = epochal_command("hooks", cwd=tmp_path, env={"COLUMNS": ""})  # a reference: 80 in a pipe
    assert max(map(len, piped.stdout.splitlines())) <= 80
    listing = epochal_command("plugins", cwd=tmp_path, env={"COLUMNS": "80"})
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    tables = [block.splitlines() for block in listing.stdout.split("\n\n") if block.strip()]
    assert len(tables) >= 2 and all(table[0].startswith("name ") for table in tables), tables
    # the second table's rows are keyed by the plugin's name, not a row number
    second = {line.split()[0] for line in tables[1][1:] if line and not line[0].isspace()}
    first = {line.split()[0] for line in tables[0][1:]}
    assert second and second <= first


def test_a_path_in_a_table_breaks_after_a_slash_never_inside_a_name() -> None:
    path = "runs/some/very/long/directory/for_experiments_with_digits/version_0"
    text = render_table(("run_id", "run_dir"), [("80e399b8c2c5", path)], width=60, paths=(1,))
    lines = text.splitlines()
    assert max(map(len, lines)) <= 60
    pieces = [line[14:].strip() for line in lines[1:]]
    assert "".join(pieces) == path
    assert all(piece.endswith("/") for piece in pieces[:-1]), pieces  # cut only after a slash


class Described(TinyModel):
    def summary(self) -> str:
        return "TinyModel: 3 parameters (3 trainable), 24 B, float64 on the host, " + "x" * 30


def test_the_model_line_fits_the_terminal(capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    run_loop({"epochal.summary": RunSummary()}, model=Described(), data=tiny_data(), max_epochs=1)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line]
    assert lines[0].startswith("epochal: model TinyModel: 3 parameters")
    assert max(map(len, lines)) <= 80, lines
    assert "float64 on the host" in " ".join(err.split())
