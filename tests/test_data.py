"""BatchStream: deterministic order, exact mid-epoch resumption, errors; batch_size."""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np
import pytest

from epochal.batch_rules import batch_size, empty_rule
from epochal.data import BatchStream


def arrays(n: int = 10) -> tuple[np.ndarray, np.ndarray]:
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    return x, np.arange(n) * 10


def epochs(stream: BatchStream, count: int) -> list[list[tuple[np.ndarray, ...]]]:
    return [list(stream) for _ in range(count)]


def assert_same_batches(a: list, b: list) -> None:
    assert len(a) == len(b)
    for left, right in zip(a, b, strict=True):
        for u, v in zip(left, right, strict=True):
            assert u.dtype == v.dtype
            np.testing.assert_array_equal(u, v)


def test_epoch_order_derives_from_seed_and_epoch_only() -> None:
    x, y = arrays()
    stream = BatchStream(x, y, batch_size=4, seed=3)
    np.random.seed(123)  # global state must not matter
    first, second = epochs(stream, 2)
    for epoch, batches in enumerate((first, second)):
        order = np.random.default_rng([3, epoch]).permutation(10)
        np.testing.assert_array_equal(np.concatenate([b[1] for b in batches]), order * 10)
        np.testing.assert_array_equal(np.concatenate([b[0] for b in batches]), x[order])
    assert [len(b[0]) for b in first] == [4, 4, 2]
    assert stream.state_dict() == {"seed": 3, "epoch": 2, "position": 0, "batches": 3}
    np.random.seed(7)
    assert_same_batches(first, list(BatchStream(x, y, batch_size=4, seed=3)))
    other = np.concatenate([b[1] for b in BatchStream(x, y, batch_size=4, seed=4)])
    assert not np.array_equal(other, np.concatenate([b[1] for b in first]))


def test_no_shuffle_keeps_the_stored_order_and_batches_are_fresh_arrays() -> None:
    x, y = arrays()
    stream = BatchStream(x, y, batch_size=4, shuffle=False)
    for _ in range(2):
        batches = list(stream)
        np.testing.assert_array_equal(np.concatenate([b[0] for b in batches]), x)
    batches[0][0][:] = -1
    assert x.min() == 0  # the batch did not alias the input
    assert not np.shares_memory(batches[0][0], x)


def test_single_array_yields_arrays_not_tuples() -> None:
    x, _ = arrays()
    batches = list(BatchStream(x, batch_size=5, shuffle=False))
    assert all(isinstance(b, np.ndarray) for b in batches)
    np.testing.assert_array_equal(batches[1], x[5:])


@pytest.mark.parametrize(
    ("n", "size", "drop_last", "expected"),
    [
        (10, 4, False, 3),
        (10, 4, True, 2),
        (8, 4, False, 2),
        (8, 4, True, 2),
        (3, 4, True, 0),
        (3, 4, False, 1),
        (0, 4, False, 0),
    ],
)
def test_len_and_drop_last(n: int, size: int, drop_last: bool, expected: int) -> None:
    x, y = arrays(n)
    stream = BatchStream(x, y, batch_size=size, drop_last=drop_last)
    assert len(stream) == expected
    batches = list(stream)
    assert len(batches) == expected
    if drop_last:
        assert all(len(b[0]) == size for b in batches)
    assert sum(len(b[0]) for b in batches) == (n // size * size if drop_last else n)
    assert stream.epoch == 1


@pytest.mark.parametrize("stop", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
def test_resume_from_state_dict_yields_the_same_remaining_batches(stop: int) -> None:
    """Save the state while the `stop`-th batch (0 = before any) is being processed."""
    x, y = arrays(10)
    reference = [b for epoch in epochs(BatchStream(x, y, batch_size=4, seed=5), 3) for b in epoch]

    stream = BatchStream(x, y, batch_size=4, seed=5)
    seen, state = [], stream.state_dict()
    iterator = iter(stream)
    while len(seen) < stop:
        try:
            seen.append(next(iterator))
        except StopIteration:  # epoch end: the next epoch is a new iteration
            iterator = iter(stream)
            continue
        state = json.loads(json.dumps(stream.state_dict()))  # JSON-able
        in_epoch = (len(seen) - 1) % 3 + 1
        assert state == {"seed": 5, "epoch": (len(seen) - 1) // 3, "position": in_epoch, "batches": 3}

    resumed = BatchStream(x, y, batch_size=4, seed=5)
    resumed.load_state_dict(state)
    rest = []
    while len(seen) + len(rest) < len(reference):
        rest.extend(resumed)
    assert_same_batches(seen + rest, reference)


def test_state_at_the_last_batch_resumes_with_an_empty_end_of_epoch() -> None:
    x, y = arrays(10)
    stream = BatchStream(x, y, batch_size=5, seed=1)
    for _ in stream:
        state = stream.state_dict()
    assert state == {"seed": 1, "epoch": 0, "position": 2, "batches": 2}
    resumed = BatchStream(x, y, batch_size=5, seed=1)
    resumed.load_state_dict(state)
    assert list(resumed) == []
    assert resumed.state_dict() == {"seed": 1, "epoch": 1, "position": 0, "batches": 2}
    assert_same_batches(list(resumed), list(stream))


def test_abandoned_iteration_keeps_its_position() -> None:
    x, y = arrays(10)
    stream = BatchStream(x, y, batch_size=2, seed=2)
    for i, _ in enumerate(stream):
        if i == 1:
            break
    assert stream.state_dict() == {"seed": 2, "epoch": 0, "position": 2, "batches": 5}
    rest = list(stream)
    assert len(rest) == 3
    assert stream.state_dict() == {"seed": 2, "epoch": 1, "position": 0, "batches": 5}


def test_loading_state_during_an_iteration_is_refused() -> None:
    x, y = arrays(10)
    stream = BatchStream(x, y, batch_size=2)
    iterator = iter(stream)
    next(iterator)
    stream.load_state_dict({"seed": 0, "epoch": 4, "position": 0})
    with pytest.raises(RuntimeError, match="changed during an iteration"):
        next(iterator)


def test_constructor_errors() -> None:
    x, y = arrays(10)
    with pytest.raises(ValueError, match=r"10 \(array 0\), 9 \(array 1\)"):
        BatchStream(x, y[:9], batch_size=2)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="batch_size must be a positive int"):
            BatchStream(x, batch_size=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        BatchStream(x, batch_size=2, seed=-1)
    with pytest.raises(ValueError, match="at least one array"):
        BatchStream(batch_size=2)


def test_load_state_dict_errors() -> None:
    x, _ = arrays(10)
    stream = BatchStream(x, batch_size=2, seed=3)
    with pytest.raises(ValueError, match=r"missing keys \['position'\]; unknown keys \['pos'\]"):
        stream.load_state_dict({"seed": 3, "epoch": 0, "pos": 1})
    with pytest.raises(ValueError, match="seeded with 4 into one seeded with 3"):
        stream.load_state_dict({"seed": 4, "epoch": 0, "position": 0})
    with pytest.raises(ValueError, match="position 6 is beyond the 5 batches"):
        stream.load_state_dict({"seed": 3, "epoch": 0, "position": 6})
    with pytest.raises(ValueError, match="'epoch' must be a non-negative int"):
        stream.load_state_dict({"seed": 3, "epoch": -1, "position": 0})
    assert stream.state_dict() == {"seed": 3, "epoch": 0, "position": 0, "batches": 5}  # unchanged
    stream.load_state_dict({"seed": np.int64(3), "epoch": 2, "position": 5})
    assert stream.state_dict() == {"seed": 3, "epoch": 2, "position": 5, "batches": 5}
    assert all(type(v) is int for v in stream.state_dict().values())


def test_batch_size_helper() -> None:
    x = np.zeros((7, 3))
    assert batch_size(x) == 7
    assert batch_size((x, np.zeros(7))) == 7
    assert batch_size([x[:2], x]) == 2
    assert batch_size(()) == 0
    assert batch_size({"image": x[:5], "label": x}) == 5
    assert batch_size(OrderedDict(label=[1, 2, 3])) == 3
    assert batch_size({}) == 0
    assert batch_size(np.float32(1.0)) == 1
    assert batch_size(np.array(3.0)) == 1
    assert batch_size((1.5, 2.5)) == 1  # one example (x, y)
    # found by an outside-user pass: a list of token ids or texts weighed 1 (or a text's length)
    assert batch_size([1, 1, 1]) == 3 and batch_size(["hello", "x"]) == 2 and batch_size(["", "x"]) == 2
    assert batch_size(object()) == 1
    assert batch_size("abcd") == 4


def test_batch_size_of_an_array_like_reads_its_shape_not_its_len() -> None:
    # a tensor's shape[0] is read in C, its len() in Python; an array-like whose len() refuses
    # (a scipy.sparse matrix: "length is ambiguous") still counts its rows
    class Sparse:
        ndim, shape = 2, (6, 4)

        def __len__(self) -> int:
            raise TypeError("sparse array length is ambiguous")

    class Scalar(Sparse):
        ndim, shape = 0, ()

    assert batch_size(Sparse()) == 6 and batch_size((Sparse(), np.zeros(2))) == 6
    assert batch_size({"x": Sparse()}) == 6 and batch_size(Scalar()) == 1
    torch = pytest.importorskip("torch")
    assert batch_size((torch.zeros(5, 3), torch.zeros(5))) == 5 and batch_size(torch.zeros(0, 2)) == 0


def test_batch_size_of_arrays_tuples_lists_and_dicts_counts_the_first_array() -> None:
    from collections import namedtuple

    x, empty, scalar = np.zeros((4, 2)), np.zeros((0, 2)), np.array(2.0)
    pair = namedtuple("pair", "x y")
    for batch, expected in [
        (x, 4),
        (empty, 0),
        (scalar, 1),  # a 0-d array: one example
        ((empty, x), 0),
        ([scalar, x], 1),
        ({"x": empty, "y": x}, 0),
        ({"s": scalar}, 1),
        ([[1, 2, 3], [4]], 3),  # a list's length
        ({"ids": [1, 2]}, 2),
        (([],), 0),
        ([], 0),
        (pair(x[:3], x), 3),  # a tuple subclass: the same rule
        ({"a": 1.5}, 1),
    ]:
        assert batch_size(batch) == expected, batch


def test_batch_size_without_len_raises_nothing() -> None:
    """Objects without ``len`` count as one example, found without a raised TypeError."""

    class Opaque:
        def __init__(self) -> None:
            self.x = np.zeros(4)

    class Sized:
        def __len__(self) -> int:
            return 6

    class ZeroD:  # a __len__ that refuses, like a 0-d tensor's
        def __len__(self) -> int:
            raise TypeError("len() of a 0-d tensor")

    assert batch_size(Opaque()) == 1
    assert batch_size({"a": Opaque()}) == 1
    assert batch_size((Opaque(), 2)) == 1
    assert batch_size(Sized()) == 6 and batch_size([Sized()]) == 6
    assert batch_size(ZeroD()) == 1 and batch_size({"t": ZeroD()}) == 1
    assert batch_size((np.array(2.0),)) == 1


def test_empty_rule_agrees_with_batch_size_for_every_batch_type() -> None:
    """The loop's per-type emptiness check says "empty" exactly when ``batch_size`` is 0."""

    class Opaque:
        pass

    class Sized:
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

    class ZeroD:
        def __len__(self) -> int:
            raise TypeError("len() of a 0-d tensor")

    x = np.zeros((7, 3))
    batches = [
        x,
        x[:0],
        np.array(3.0),
        np.float32(1.0),
        (x, x),
        (x[:0], x),
        (np.array(2.0), x),
        (),
        [x[:2]],
        [[], x],
        ([1, 2], x),
        ((), x),
        (Opaque(), x),
        (ZeroD(), x),
        (1.5, 2.5),
        {"image": x[:5], "label": x},
        {"image": x[:0], "label": x},
        {"a": np.array(1.0)},
        {},
        OrderedDict(label=[1, 2, 3]),
        OrderedDict(label=[]),
        {"a": Opaque()},
        {"a": Sized(0)},
        Opaque(),
        Sized(0),
        Sized(4),
        ZeroD(),
        "",
        "abcd",
    ]
    for batch in batches:
        rule = empty_rule(type(batch))
        empty = False if rule is None else bool(rule(batch))
        assert empty == (batch_size(batch) == 0), batch
    assert empty_rule(Opaque) is None  # never empty: the loop checks nothing


def test_loop_skips_empty_batches_of_every_type() -> None:
    from epochal import Loop
    from epochal.testing import StubModel

    class Model(StubModel):
        def __init__(self) -> None:
            super().__init__(evaluation={})
            self.seen: list[object] = []

        def train_step(self, batch: object) -> dict[str, float]:
            self.seen.append(batch)
            return {}

    x = np.zeros((3, 2))
    full = [x, (x, x), {"a": x}, [x], OrderedDict(a=[1]), {"a": np.array(1.0)}, {"a": [1], "b": []}]
    empty = [x[:0], (x[:0], x), {"a": x[:0]}, [], {}, OrderedDict(a=[]), {"a": [], "b": x}, {"a": x[:0, 0]}]
    stream = [b for pair in zip(full + full, empty + full) for b in pair]
    model = Model()
    loop = Loop(model, {"train": stream}, max_epochs=1, on_empty_batch="ignore", handle_signals=False)
    loop.run()
    assert [id(b) for b in model.seen] == [id(b) for b in stream if batch_size(b) != 0]
    assert loop.iteration == len(model.seen) == len(stream) - len(empty)


def test_a_position_inside_an_epoch_of_another_length_is_refused() -> None:
    x, _ = arrays(10)
    saved = BatchStream(x, batch_size=2, seed=3)
    iterator = iter(saved)
    next(iterator), next(iterator)
    state = saved.state_dict()
    assert state == {"seed": 3, "epoch": 0, "position": 2, "batches": 5}
    smaller = BatchStream(x, batch_size=3, seed=3)  # 4 batches an epoch: other examples after batch 2
    with pytest.raises(ValueError, match=r"saved at batch 2 of an epoch of 5 batches: its epoch now has 4"):
        smaller.load_state_dict(state)
    # at an epoch's end (and from a state saved before 'batches' was) the next epoch starts afresh
    smaller.load_state_dict({**state, "position": 5})
    assert smaller.state_dict() == {"seed": 3, "epoch": 0, "position": 4, "batches": 4}
    assert list(smaller) == [] and smaller.state_dict()["epoch"] == 1  # then the next epoch
    assert len(list(smaller)) == 4
    smaller.load_state_dict({"seed": 3, "epoch": 0, "position": 2})
    with pytest.raises(ValueError, match="'batches' must be a non-negative int"):
        smaller.load_state_dict({**state, "batches": -1})
