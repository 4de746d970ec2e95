"""storage.npy: .npy record headers, parsed without numpy's tokenizer; pickle payloads refused."""

from __future__ import annotations

import io
import json
import random
import re
import tokenize
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from epochal_checkpoint import CorruptCheckpointError, UnsafeCheckpointError, load_latest, read_checkpoint
from epochal_checkpoint.storage import npy
from epochal_checkpoint.storage.codec import flatten
from epochal_checkpoint.storage.load import read_state_document
from epochal_checkpoint.storage.npy import NPY_HEADER_FIRST, header_size, npy_header, parse_npy_header
from epochal_checkpoint.storage.write import write_checkpoint
from epochal_checkpoint.testing import resign


def save(directory: Path, state: dict[str, Any], name: str = "ckpt-e0000-i000001", sequence: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return write_checkpoint(directory, name, flatten(state), {"sequence": sequence, "run_id": "r"}).path


def forge_object_array_checkpoint(path: Path) -> None:
    """Replace the data file with one holding a pickled object array, checksums fixed up."""
    payload = np.array([{"evil": "payload"}], dtype=object)
    state = read_state_document(path)
    state["arrays"] = [
        {"path": ["w"], "kind": "array", "dtype": "|O", "shape": [1], "offset": 0, "crc32": "00000000"}
    ]
    with open(path / "data.bin", "wb") as file:
        np.save(file, payload, allow_pickle=True)
        file.write(json.dumps(state, separators=(",", ":")).encode())
    resign(path)


def test_a_pickle_payload_is_refused(tmp_path: Path) -> None:
    path = save(tmp_path, {"w": np.zeros(2)})
    forge_object_array_checkpoint(path)
    with pytest.raises(UnsafeCheckpointError, match=r"data.bin array 'w' holds a pickle payload"):
        read_checkpoint(path)
    with pytest.raises(UnsafeCheckpointError), pytest.warns(RuntimeWarning, match="pickle payload"):
        load_latest(tmp_path)  # never silently skipped: a warning names it (then older ones are tried)


def header_of(array: np.ndarray) -> bytes:
    return npy_header(np.ascontiguousarray(array) if array.ndim else array)


ARRAYS = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
    np.array(7, dtype=np.uint8),
    np.zeros((0, 5), dtype=np.complex64),
    np.arange(3, dtype=">i4"),
    np.array([(1, 2.5)], dtype=[("a", "i4"), ("b", "f8")]),
    np.array([(1, (2, 3))], dtype=[("O", "i4"), ("nested", [("x", "u1"), ("y", "<f2")])]),
    np.array(["2024-01-01"], dtype="datetime64[D]"),
    np.array(["ab", "c"], dtype="<U2"),
    np.array([True, False]),
    np.zeros((2, 3), dtype=np.dtype(("<f4", (4,)))),
]
#: an object array's header (a pickle payload follows it in a forged file).
OBJECT = npy_header(np.array([None, 1], dtype=object))


@pytest.mark.parametrize("array", ARRAYS, ids=lambda a: str(a.dtype))
def test_a_header_parses_as_numpy_reads_it(array: np.ndarray) -> None:
    head = header_of(array) + b"trailing array bytes"
    stream = io.BytesIO(head)
    assert np.lib.format.read_magic(stream) == (1, 0)
    shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
    assert parse_npy_header("x", head) == (shape, fortran, dtype, stream.tell())


def test_a_version_2_header_parses_and_a_version_3_one_is_refused() -> None:
    array = np.zeros(3, dtype=[("a", "<f8"), ("b", "<i2")])
    buffer = io.BytesIO()
    np.lib.format.write_array_header_2_0(buffer, np.lib.format.header_data_from_array_1_0(array))
    head = buffer.getvalue()
    assert head[6:8] == b"\x02\x00"
    assert parse_npy_header("x", head) == ((3,), False, array.dtype, len(head))
    with pytest.raises(
        CorruptCheckpointError, match=r"'x' has a bad .npy header: unsupported .npy version 3.0"
    ):
        parse_npy_header("'x'", head[:6] + b"\x03\x00" + head[8:])


def test_an_unbalanced_bracket_is_a_corruption_error_not_numpys_tokenizer_error() -> None:
    """Issue 31: numpy's header reader raises tokenize.TokenError on an unbalanced bracket."""
    head = header_of(np.zeros(3, np.float32))
    broken = head.replace(b"}", b" ", 1)
    with pytest.raises(tokenize.TokenError):  # what numpy does with it
        stream = io.BytesIO(broken)
        np.lib.format.read_magic(stream)
        np.lib.format.read_array_header_1_0(stream)
    with pytest.raises(CorruptCheckpointError, match=r"array 'w' has a bad .npy header: not a dict literal"):
        parse_npy_header("array 'w'", broken)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{'descr': '|O', 'fortran_order': False, 'shape': (1,), }", None),
        ("{'descr': [('a', '<i4'), ('b', '|O')], 'fortran_order': False, 'shape': (1,), }", None),
        ("{'descr': '<f4', 'fortran_order': 0, 'shape': (1,), }", "fortran_order 0 is not a bool"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }", "shape (-1,) is not a tuple"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': [1], }", "shape [1] is not a tuple"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (True,), }", "shape (True,) is not a tuple"),
        ("{'descr': '<f4', 'fortran_order': False}", "not a dict of descr, fortran_order and shape"),
        ("{'descr': 'nonsense', 'fortran_order': False, 'shape': ()}", "descr 'nonsense' is not a dtype"),
        ("{'descr': 4, 'fortran_order': False, 'shape': ()}", "descr 4 is not a dtype description"),
        ("__import__('os').system('echo pwned')", "not a dict literal (ValueError"),
        ("(" * 5000, "not a dict literal"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }\x00", "not a dict literal"),
    ],
)
def test_bad_header_texts_are_named_and_object_dtypes_refused(text: str, why: str | None) -> None:
    body = text.encode("latin-1")
    head = b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body
    if why is None:
        with pytest.raises(UnsafeCheckpointError, match="holds a pickle payload"):
            parse_npy_header("x", head)
    else:
        with pytest.raises(CorruptCheckpointError, match=re.escape(f"x has a bad .npy header: {why}")):
            parse_npy_header("x", head)


@pytest.mark.parametrize(
    ("head", "why"),
    [
        (b"", "no .npy magic string"),
        (b"\x93NUMPZ\x01\x00\x10\x00", "no .npy magic string"),
        (b"\x93NUMPY\x01\x00\x01", "truncated"),
        (b"\x93NUMPY\x02\x00\xff\xff\xff\x00", "16777215 bytes long, more than the 65536 allowed"),
        (b"\x93NUMPY\x01\x00\x50\x00{'descr'", "truncated (8 of 80 bytes)"),
    ],
)
def test_bad_magic_versions_and_lengths_are_named(head: bytes, why: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"x has a bad .npy header: {why}")):
        parse_npy_header("x", head)


#: bytes a damaged header likely holds: the literal's own punctuation, quotes, controls.
_TOKENS = [b"{", b"}", b"(", b")", b"[", b"]", b"'", b'"', b",", b":", b" ", b"\n", b"\x00", b"\\",
           b"#", b"-1", b"1e999", b"True", b"None", b"|O", b"<f4", b"'descr'", b"'shape'", b"\xff",
           b"\x93NUMPY"]  # fmt: skip


def _mutate(rng: random.Random, head: bytes) -> bytes:
    data = bytearray(head)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(7)
        at = rng.randrange(len(data) + 1)
        if kind == 0 and data:  # flip bits of a byte
            data[min(at, len(data) - 1)] ^= 1 << rng.randrange(8)
        elif kind == 1 and data:  # replace a byte by a token's
            data[min(at, len(data) - 1) : min(at, len(data) - 1) + 1] = rng.choice(_TOKENS)
        elif kind == 2:  # insert a token
            data[at:at] = rng.choice(_TOKENS)
        elif kind == 3:  # delete a run of bytes
            del data[at : at + rng.randint(1, 8)]
        elif kind == 4:  # truncate
            del data[at:]
        elif kind == 5 and len(data) >= 10:  # change the version or the length field
            data[rng.choice((6, 7, 8, 9))] = rng.randrange(256)
        else:  # random bytes
            data[at:at] = rng.randbytes(rng.randint(1, 16))
    return bytes(data)


@pytest.mark.filterwarnings("error")
def test_fuzzed_headers_only_parse_or_raise_the_packages_own_errors() -> None:
    """10,000+ damaged headers (mutations of valid ones, and random bytes): each parses into a
    consistent header or raises CorruptCheckpointError (UnsafeCheckpointError for an object
    dtype), never any other exception nor a warning."""
    rng = random.Random(31)
    valid = [header_of(array) for array in ARRAYS] + [OBJECT]
    outcomes = {"parsed": 0, "corrupt": 0, "unsafe": 0}
    for case in range(12_000):
        if case % 10 == 0:
            head = rng.randbytes(rng.randint(0, 200))
        elif case % 10 == 1:
            head = b"\x93NUMPY\x01\x00" + rng.randbytes(rng.randint(0, 200))
        else:
            head = _mutate(rng, rng.choice(valid))
        try:
            shape, fortran, dtype, length = parse_npy_header("x", head)
        except UnsafeCheckpointError:
            outcomes["unsafe"] += 1
            continue
        except CorruptCheckpointError as error:
            assert str(error).startswith("x has a bad .npy header: "), error
            outcomes["corrupt"] += 1
            continue
        outcomes["parsed"] += 1
        assert 10 <= length <= len(head)
        assert type(shape) is tuple and all(type(n) is int and n >= 0 for n in shape)
        assert type(fortran) is bool and isinstance(dtype, np.dtype) and not dtype.hasobject
    assert sum(outcomes.values()) == 12_000
    assert min(outcomes.values()) > 0, outcomes  # every outcome reached: the fuzz hits the parser


#: the arrays of tensors (every dtype torch shares with numpy, and the bits of the others).
TENSOR_ARRAYS = [
    np.zeros(shape, dtype=dtype, order=order)
    for dtype in ("<f2", "<f4", "<f8", "<c8", "<c16", "|b1", "|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<u8",
                  "<i8")
    for shape in [(), (0,), (7,), (3, 4), (2, 0, 5), (1,) * 9, (123456789, 0)]
    for order in ("C", "F")
]  # fmt: skip


def _outcome(head: bytes) -> Any:
    """What parse_npy_header makes of *head*: the result, or the error's type and message
    (objects' addresses left out)."""
    try:
        return parse_npy_header("x", head)
    except (CorruptCheckpointError, UnsafeCheckpointError) as error:
        return type(error), re.sub(r" at 0x[0-9a-f]+", "", str(error))


def _general(monkeypatch: pytest.MonkeyPatch, head: bytes) -> Any:
    """:func:`_outcome` without parse_npy_header's plain-header path."""
    with monkeypatch.context() as patch:
        patch.setattr(npy, "_PLAIN", re.compile(r"(?!)"))  # matches nothing
        return _outcome(head)


def test_numpys_headers_of_tensor_arrays_take_the_plain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The headers a checkpoint of tensors holds are read without ast.literal_eval (the plain
    path, ~5x faster per record), into what the general path reads."""
    for array in TENSOR_ARRAYS:
        head = npy_header(array)
        expected = _general(monkeypatch, head)
        with monkeypatch.context() as patch:
            patch.setattr(npy.ast, "literal_eval", None)  # the general path would fail
            assert parse_npy_header("x", head) == expected, head


@pytest.mark.parametrize(
    "text",
    [
        "{'descr': '<f4', 'fortran_order': False, 'shape': (5), }",  # an int, not a tuple
        "{'descr': '<f4', 'fortran_order': False, 'shape': (007,), }",  # no literal
        "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4,), }",  # a tuple all the same
        "{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }",
        "{'descr': '<f4', 'fortran_order': 0, 'shape': (1,), }",
        "{'descr': '|O8', 'fortran_order': False, 'shape': (1,), }",
        "{'descr': '<x4', 'fortran_order': False, 'shape': (1,), }",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }  \t\n",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), } \n\n",
        "{'descr':'<f4', 'fortran_order': False, 'shape': (1,), }\n",
        "{'fortran_order': False, 'descr': '<f4', 'shape': (1,), }\n",
    ],
)
def test_a_near_plain_header_reads_as_the_general_path_reads_it(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    body = text.encode("latin-1")
    head = b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body
    assert _outcome(head) == _general(monkeypatch, head)


def test_fuzzed_plain_headers_read_as_the_general_path_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """5,000 mutations of tensor arrays' headers: the same result or error with and without the
    plain path (it never reads a damaged header another way than ast.literal_eval does)."""
    rng = random.Random(32)
    valid = [npy_header(array) for array in TENSOR_ARRAYS]
    parsed = 0
    for _ in range(5_000):
        head = _mutate(rng, rng.choice(valid))
        got = _outcome(head)
        assert got == _general(monkeypatch, head), head
        parsed += type(got[0]) is tuple  # a shape: it parsed
    assert parsed >= 25  # the mutations reach headers that still parse (48 with this seed)


def test_header_size_is_the_length_the_parser_finds() -> None:
    for array in [*ARRAYS, *TENSOR_ARRAYS[::7]]:
        head = header_of(array)
        assert header_size(head + b"data") == parse_npy_header("x", head + b"data")[3] == len(head)
    assert header_size(b"\x93NUMPY\x01") is None  # too short to say
    assert header_size(b"\x93NUMPZ\x01\x00\x10\x00") is None  # no magic
    assert header_size(b"\x93NUMPY\x03\x00\x10\x00") is None  # no version it knows


def test_a_record_whose_header_is_longer_than_the_first_read_loads(tmp_path: Path) -> None:
    """A reader fetches NPY_HEADER_FIRST bytes of a record first; a longer header (a structured
    dtype of many fields) is fetched again whole."""
    fields = np.dtype([(f"field_{i:03d}", "<f8") for i in range(60)])
    array = np.zeros(3, fields)
    array["field_007"] = [1.0, 2.0, 3.0]
    assert len(header_of(array)) > NPY_HEADER_FIRST
    path = save(tmp_path, {"w": array, "v": np.arange(4.0)})
    state, _ = read_checkpoint(path)
    assert state["w"].dtype == fields and np.array_equal(state["w"], array)
    assert np.array_equal(state["v"], np.arange(4.0))


def test_a_kept_header_is_numpys_own() -> None:
    """npy_header keeps the header of each dtype, shape and order: asked again (a save of the
    same tensors), it is still byte for byte what numpy writes for that array."""
    arrays = [*ARRAYS, *TENSOR_ARRAYS, np.zeros((4, 3))[:, ::2], np.zeros((3, 4)).T]
    for _ in range(2):
        for array in arrays:
            buffer = io.BytesIO()
            np.lib.format.write_array_header_1_0(buffer, np.lib.format.header_data_from_array_1_0(array))
            assert npy_header(array) == buffer.getvalue(), array.dtype
