"""Tables that fit the terminal are laid out without rich, character for character as rich does."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from epochal import console

PRINTABLE = st.characters(min_codepoint=32, max_codepoint=126)


def by_rich(header: list[str], rows: list[list[str]], width: int, numeric: set[int]) -> str:
    from rich.console import Console

    printer = Console(width=width, color_system=None, force_terminal=False, record=True)
    with printer.capture() as captured:
        printer.print(console._table(header, rows, None, numeric, set()))
    return "\n".join(line.rstrip() for line in captured.get().splitlines())


@settings(max_examples=400, deadline=None)
@given(
    st.integers(1, 5).flatmap(
        lambda n: st.tuples(
            st.lists(st.text(PRINTABLE, max_size=8), min_size=n, max_size=n),
            st.lists(st.lists(st.text(PRINTABLE, max_size=20), min_size=n, max_size=n), max_size=4),
            st.sets(st.integers(0, n - 1)),
            st.integers(1, 80),
        )
    )
)
def test_a_table_laid_out_without_rich_is_what_rich_prints(
    table: tuple[list[str], list[list[str]], set[int], int],
) -> None:
    header, rows, numeric, width = table
    plain = console._aligned(header, rows, width, numeric)
    if plain is not None:
        assert plain == by_rich(header, rows, width, numeric)


def test_what_rich_would_change_or_wrap_goes_to_rich() -> None:
    header = ["name", "value"]
    for cell in ("[bold]x[/]", ":thumbs_up: :x:", "a  b", " lead", "tab\there", "é", "line\nbreak"):
        assert console._aligned(header, [["a", cell]], 200, set()) is None
    assert console._aligned(header, [["a", "b" * 40]], 20, set()) is None  # wraps
    assert console._aligned(header, [["a", "12:30"]], 200, set()) == "name  value\na     12:30"
    assert console.render_table(header, [["a", "b" * 40]], width=20).count("\n") > 2  # rich folded it


def test_the_plugins_listing_is_aligned_columns() -> None:
    text = console.render_table(
        ("#", "name", "hooks"),
        [("0", "monitor", "after_batch, after_epoch"), ("10", "x", "")],
        numeric=(0,),
        width=80,
    )
    assert text.splitlines() == [" #  name     hooks", " 0  monitor  after_batch, after_epoch", "10  x"]


def test_cells_and_keys_are_text_not_markup() -> None:
    """An error message with ``[brackets]`` in ``log runs``' reason column lost them to rich's
    markup; a log key is a column header in ``log show``."""
    header = ["run_id", "x[1]"]
    reason = "ValueError: a [bold]message[/bold] :smile: with [brackets] that wraps at the edge"
    text = console.render_table(header, [["ef5dcd013aa1", reason]], width=40)
    assert max(map(len, text.splitlines())) <= 40
    assert " ".join(text.split()).count("[bold]message[/bold] :smile: with [brackets]") == 1, text
    assert "x[1]" in text.splitlines()[0]
