"""storage.codec: flattening a state, data.bin's layout, exact round trips, refused values."""

from __future__ import annotations

import enum
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from epochal_checkpoint import UnsupportedStateError, read_checkpoint
from epochal_checkpoint.storage.codec import flatten
from epochal_checkpoint.storage.write import write_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st


class Color(enum.IntEnum):
    RED = 1


def save(directory: Path, state: dict[str, Any], name: str = "ckpt-e0000-i000001", sequence: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return write_checkpoint(directory, name, flatten(state), {"sequence": sequence, "run_id": "r"}).path


def tricky_state() -> dict[str, Any]:
    return {
        "ints": [0, -1, 2**63, -(2**64) - 1, 2**100, 3**9000, Color.RED],
        "floats": [0.1, -0.0, math.inf, -math.inf, 1e-320, 1.7976931348623157e308],
        "nan": math.nan,
        "strings": ["", "ünïcode", "\ud800 lone surrogate", "null"],
        "flags": [True, False, None],
        "tuple": (1, (2, "three")),
        "nested": {"a": {"b": {"c": []}}, "empty": {}},
        "arrays": {
            "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
            "fortran": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
            "strided": np.arange(10, dtype=np.float64)[::3],
            "zero_d": np.array(7, dtype=np.uint8),
            "empty": np.zeros((0, 5), dtype=np.complex64),
            "big_endian": np.arange(3, dtype=">i4"),
            "structured": np.array([(1, 2.5)], dtype=[("a", "i4"), ("b", "f8")]),
            "dates": np.array(["2024-01-01"], dtype="datetime64[D]"),
            "bools": np.array([True, False]),
        },
        "scalars": [np.float32(1.5), np.int64(-3), np.bool_(True), np.float64(0.25)],
        "list_of_arrays": [np.ones(2), {"deep": np.zeros(1, dtype=np.int8)}],
    }


def test_round_trip_is_exact_tuples_become_lists(tmp_path: Path) -> None:
    state = tricky_state()
    loaded, manifest = read_checkpoint(save(tmp_path, state))
    assert manifest["sequence"] == 1 and set(manifest["files"]) == {"data.bin"}
    assert loaded["ints"] == [0, -1, 2**63, -(2**64) - 1, 2**100, 3**9000, 1]
    assert [repr(f) for f in loaded["floats"]] == [repr(f) for f in state["floats"]]
    assert math.isnan(loaded["nan"])
    assert loaded["strings"] == state["strings"] and loaded["flags"] == state["flags"]
    assert loaded["tuple"] == [1, [2, "three"]]
    assert loaded["nested"] == state["nested"]
    for key, array in state["arrays"].items():
        got = loaded["arrays"][key]
        assert type(got) is np.ndarray and got.dtype == array.dtype and got.shape == array.shape, key
        assert got.tobytes() == np.ascontiguousarray(array).tobytes(), key
    for want, got in zip(state["scalars"], loaded["scalars"], strict=True):
        assert type(got) is type(want) and got == want
    assert loaded["list_of_arrays"][1]["deep"].dtype == np.int8


_NUMBER = st.one_of(
    st.integers(min_value=-(2**4001), max_value=2**4001),
    st.sampled_from([2**4000, -(2**4000), 2**4000 - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(items=st.lists(_NUMBER, min_size=0, max_size=40), as_tuple=st.booleans())
def test_lists_of_numbers_flatten_as_their_items_one_by_one(items: list[Any], as_tuple: bool) -> None:
    # Long lists of plain numbers take a fast path (a generator's 625 ints): the same result as
    # each item flattened on its own, big ints (above 4000 bits) kept as hex by their index.
    snapshot = flatten(tuple(items) if as_tuple else items)
    one_by_one = [flatten(item) for item in items]
    assert [repr(x) for x in snapshot.tree] == [repr(s.tree) for s in one_by_one]
    assert [type(x) for x in snapshot.tree] == [type(s.tree) for s in one_by_one]
    assert snapshot.ints == [
        {"path": [i], "hex": entry["hex"]} for i, s in enumerate(one_by_one) for entry in s.ints
    ]


_SCALAR = st.one_of(_NUMBER, st.none(), st.text(max_size=5))


@settings(max_examples=300, deadline=None)
@given(row=st.dictionaries(st.text(max_size=4), _SCALAR, max_size=12))
def test_dicts_of_scalars_flatten_as_their_values_one_by_one(row: dict[str, Any]) -> None:
    # A dict of scalars (a log row, a plugin's counters) is copied at C speed: the same tree and
    # the same big ints (by key path) as each value flattened on its own, and a copy.
    snapshot = flatten({"row": row})
    one_by_one = {key: flatten(value) for key, value in row.items()}
    assert repr(snapshot.tree["row"]) == repr({key: s.tree for key, s in one_by_one.items()})
    assert snapshot.tree["row"] is not row
    assert snapshot.ints == [
        {"path": ["row", key], "hex": entry["hex"]} for key, s in one_by_one.items() for entry in s.ints
    ]


def test_a_dict_of_scalars_with_a_key_not_a_str_is_still_refused() -> None:
    with pytest.raises(UnsupportedStateError, match=re.escape("'rows'") + ".*dict key 3 is an int"):
        flatten({"rows": {"a": 1.0, 3: 2.0}})


def test_data_file_starts_with_a_sequence_of_npy_records(tmp_path: Path) -> None:
    path = save(tmp_path, {"a": np.arange(3), "b": {"c": np.ones((2, 2), np.float32)}})
    with open(path / "data.bin", "rb") as file:
        first, second = np.load(file, allow_pickle=False), np.load(file, allow_pickle=False)
    assert first.tolist() == [0, 1, 2] and second.shape == (2, 2)


@pytest.mark.parametrize(
    ("state", "where", "what"),
    [
        ({"plugins": {"monitor": {"state": {"foo": object()}}}}, "plugins.monitor.state.foo", "object"),
        ({"log": {"rows": [1, 2, {3: "x"}]}}, "log.rows[2]", "dict key 3"),
        ({"model": {"w": np.array([object()])}}, "model.w", "dtype object"),
        ({"s": {1, 2}}, "s", "set"),
        ({"m": np.ma.masked_array([1, 2], mask=[0, 1])}, "m", "masked"),
    ],
)
def test_unsupported_values_are_refused_at_save_naming_the_key(state: Any, where: str, what: str) -> None:
    with pytest.raises(UnsupportedStateError, match=re.escape(f"'{where}'") + f".*{what}"):
        flatten(state)


def test_a_reference_cycle_is_refused() -> None:
    state: dict[str, Any] = {"a": []}
    state["a"].append(state)
    with pytest.raises(UnsupportedStateError, match=r"'a\[0\]'.*cycle"):
        flatten(state)


def test_snapshot_does_not_follow_later_changes_with_copy_arrays() -> None:
    weights, rows = np.zeros(3), {"1": {"loss": 1.0}}
    snapshot = flatten({"w": weights, "rows": rows}, copy_arrays=True)
    weights += 1
    rows["1"]["loss"] = 2.0
    assert snapshot.arrays[0].tolist() == [0, 0, 0]
    assert snapshot.tree["rows"]["1"]["loss"] == 1.0


def test_copy_arrays_keeps_an_array_made_for_the_state_alone() -> None:
    # a GPU tensor's copy on the host (marked private by TorchModel) is written as it is; a
    # view of live memory is copied, into the previous snapshot's arrays where they fit
    from epochal.private_arrays import private

    made, live = private(np.arange(3.0)), np.zeros(3)
    first = flatten({"made": made, "live": live}, copy_arrays=True)
    assert first.arrays[0] is made and first.arrays[1] is not live
    live += 1
    assert first.arrays[1].tolist() == [0, 0, 0]
    again = private(np.arange(3.0))
    second = flatten({"made": again, "live": live}, copy_arrays=True, reuse=first.arrays)
    assert second.arrays[0] is again and second.arrays[1] is first.arrays[1]
    assert second.arrays[1].tolist() == [1, 1, 1] and first.arrays[0] is made


def test_a_python_generator_state_saved_as_a_list_restores_and_is_saved_as_an_array(tmp_path: Path) -> None:
    # states written before Python's generator state became an array held its 625 words as a
    # list (the fast path of flatten): such a list round-trips as a list and still restores
    import random

    from epochal import _rng

    random.seed(5)
    captured = _rng.capture()
    captured["python"]["state"] = captured["python"]["state"].tolist()
    path = save(tmp_path, {"rng": captured})
    state, _ = read_checkpoint(path)
    saved = state["rng"]["python"]
    assert isinstance(saved["state"], list) and len(saved["state"]) == 625
    random.seed(99)
    _rng.restore(state["rng"])
    assert random.getstate() == (saved["version"], tuple(saved["state"]), saved["gauss"])
    words = _rng.capture()["python"]["state"]
    assert words.dtype == np.uint32 and words.tolist() == saved["state"]
