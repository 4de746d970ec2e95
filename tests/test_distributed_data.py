"""Sharding streams across processes: disjoint shards that cover the data, equal train shards.

Units in one process: every rank's shard is built here (``shard(rank, size)``), and the loop is
given a :class:`~epochal.distributed.World` of two ranks without a process group (nothing in
sharding or ``distribute`` needs one). The runs on real processes are in
``test_torch_distributed.py``.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from epochal import Loop
from epochal.data import BatchStream, UnevenShardsError, shard_indices
from epochal.distributed import World
from epochal.distributed.sharding import shard_stream
from epochal.errors import ConfigError
from epochal.testing import StubModel


def flatten(lists: Any) -> list[Any]:
    return list(itertools.chain.from_iterable(lists))


def ids_of(stream: Any) -> list[list[int]]:
    """The example ids of one epoch of *stream*, batch by batch."""
    return [[int(v) for v in np.asarray(batch).ravel()] for batch in stream]


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_batch_stream_shards_are_disjoint_cover_the_epoch_and_follow_its_order(
    size: int, shuffle: bool
) -> None:
    whole = BatchStream(np.arange(48), batch_size=4, shuffle=shuffle, seed=3)
    shards = [whole.shard(rank, size, "error") for rank in range(size)]
    for epoch in range(2):
        parts = [ids_of(shard) for shard in shards]
        flat = [flatten(part) for part in parts]
        assert sorted(flatten(flat)) == list(range(48))  # disjoint and covering
        assert len({len(part) for part in parts}) == 1  # the same number of batches on every rank
        order = whole.order(epoch).tolist()
        for rank in range(size):
            assert flat[rank] == order[rank::size]  # the same permutation, interleaved
        # the k-th batches of every rank together are the k-th batch of one process with size x batch
        first = sorted(flatten(part[0] for part in parts))
        assert first == sorted(order[: 4 * size])
        assert all(shard.epoch == epoch + 1 for shard in shards)


def test_uneven_train_data_is_an_error_unless_dropped_or_padded() -> None:
    stream = BatchStream(np.arange(33), batch_size=4, seed=0)
    with pytest.raises(UnevenShardsError, match="33 examples cannot be shared evenly by 2 processes"):
        stream.shard(0, 2, "error")
    dropped = [flatten(ids_of(stream.shard(rank, 2, "drop"))) for rank in range(2)]
    assert len(dropped[0]) == len(dropped[1]) == 16
    assert len(set(dropped[0]) | set(dropped[1])) == 32  # one example of the epoch left out
    padded = [flatten(ids_of(stream.shard(rank, 2, "pad"))) for rank in range(2)]
    assert len(padded[0]) == len(padded[1]) == 17
    assert set(padded[0]) | set(padded[1]) == set(range(33))  # one example seen twice
    assert padded[1][-1] == stream.order(0)[0]


def test_evaluation_shards_keep_every_example_once() -> None:
    stream = BatchStream(np.arange(21), batch_size=4, shuffle=False)
    parts = [flatten(ids_of(stream.shard(rank, 2, "keep"))) for rank in range(2)]
    assert sorted(parts[0] + parts[1]) == list(range(21))
    assert (len(parts[0]), len(parts[1])) == (11, 10)


def test_shard_indices_pads_an_epoch_smaller_than_the_world() -> None:
    assert shard_indices(np.arange(1), 2, 3, "pad").tolist() == [0]
    assert shard_indices(np.arange(2), 1, 3, "keep").tolist() == [1]
    assert shard_indices(np.arange(2), 2, 3, "keep").tolist() == []


def test_shard_state_is_the_same_on_every_rank_and_resumes_mid_epoch() -> None:
    whole = BatchStream(np.arange(40), batch_size=4, seed=1)
    straight = ids_of(whole.shard(1, 2, "error"))
    shards = [whole.shard(rank, 2, "error") for rank in range(2)]
    iterators = [iter(shard) for shard in shards]
    for iterator in iterators:
        next(iterator), next(iterator)
    states = [shard.state_dict() for shard in shards]
    assert states[0] == states[1] == {"seed": 1, "epoch": 0, "position": 2, "batches": 5, "world_size": 2}
    resumed = whole.shard(1, 2, "error")
    resumed.load_state_dict(states[1])
    assert ids_of(resumed) == straight[2:]


def test_a_state_of_another_world_size_shares_the_rest_of_its_epoch_out_afresh() -> None:
    whole = BatchStream(np.arange(40), batch_size=4, seed=1)
    order = whole.order(3)
    on_one = BatchStream(np.arange(40), batch_size=4, seed=1)
    # 2 batches of 4 on each of 2 processes: the first 16 examples of the order were trained
    on_one.load_state_dict({"seed": 1, "epoch": 3, "position": 2, "batches": 5, "world_size": 2})
    assert on_one.state_dict() == {"seed": 1, "epoch": 3, "position": 0, "batches": 6, "start": 16}
    assert [i for batch in on_one for i in batch] == order[16:].tolist()
    assert on_one.state_dict() == {"seed": 1, "epoch": 4, "position": 0, "batches": 10}
    on_one.load_state_dict({"seed": 1, "epoch": 3, "position": 0, "world_size": 2})
    assert on_one.epoch == 3 and len(on_one) == 10
    # 1 batch on 1 process leaves 36 of the order: 4 processes take 9 each ("error": it divides)
    on_four = [whole.shard(rank, 4, "error") for rank in range(4)]
    for shard in on_four:
        shard.load_state_dict({"seed": 1, "epoch": 3, "position": 1, "batches": 10})
    rest = [i for shard in on_four for batch in shard for i in batch]
    assert sorted(rest) == sorted(whole.order(3)[4:].tolist())
    # of 36 examples, 2 batches on 1 process leave 28: 3 processes cannot share them under "error"
    thirds = BatchStream(np.arange(36), batch_size=4, seed=1).shard(0, 3, "error")
    with pytest.raises(ValueError, match="28 examples, cannot be shared evenly by 3"):
        thirds.load_state_dict({"seed": 1, "epoch": 0, "position": 2, "batches": 9})
    with pytest.raises(ValueError, match="another length"):  # the batch size changed
        on_one.load_state_dict({"seed": 1, "epoch": 0, "position": 1, "batches": 3, "world_size": 2})


def test_lists_and_callables_are_sharded_by_batches() -> None:
    batches = [np.full(2, k) for k in range(6)]
    parts = [shard_stream("train", batches, rank, 2) for rank in range(2)]
    assert [int(b[0]) for b in parts[0]] == [0, 2, 4] and [int(b[0]) for b in parts[1]] == [1, 3, 5]
    factory = shard_stream("valid", lambda: batches[:5], 1, 2)
    assert [int(b[0]) for b in factory()] == [1, 3]
    with pytest.raises(
        ConfigError, match=r"\[data\] stream 'train'.*5 batches cannot be shared.*uneven_shards"
    ):
        shard_stream("train", batches[:5], 0, 2, "error").__class__  # noqa: B018


def test_a_padded_callable_stream_says_so_once_not_every_epoch(capsys: pytest.CaptureFixture[str]) -> None:
    batches = [np.full(2, k) for k in range(5)]
    factory = shard_stream("train", lambda: batches, 0, 2)  # padded by default
    assert [int(b[0]) for b in factory()] == [0, 2, 4] and [int(b[0]) for b in factory()] == [0, 2, 4]
    told = capsys.readouterr().err.splitlines()
    assert len(told) == 1 and "5 batches on 2 processes: 1 of them repeated per pass" in told[0]
    assert [int(b[0]) for b in shard_stream("train", batches, 1, 2)] == [1, 3, 0]  # the first one again


def test_a_stream_that_cannot_be_sharded_is_a_clear_error() -> None:
    def endless() -> Any:
        yield from range(3)

    with pytest.raises(
        ConfigError, match=r"stream 'train' \(generator\) cannot be sharded.*shard\(rank, size"
    ):
        shard_stream("train", endless(), 0, 2)


class Recorder(StubModel):
    """A model that records the world it is distributed to."""

    def __init__(self) -> None:
        super().__init__()
        self.worlds: list[World] = []
        self.attached = False

    def distribute(self, world: World) -> None:
        assert not self.attached, "distribute must come before attach"
        self.worlds.append(world)

    def attach(self, loop: Any) -> None:
        self.attached = True


def test_the_loop_shards_its_streams_and_distributes_the_model_once() -> None:
    world = World(rank=1, size=2)
    model = Recorder()
    data = {"train": BatchStream(np.arange(16), batch_size=4, seed=0), "valid": [np.arange(3)] * 3}
    loop = Loop(model, data, world=world, max_epochs=1, handle_signals=False)
    assert model.worlds == [world] and model.attached
    assert loop.data["train"].rank == 1 and loop.data["train"].shards == 2
    assert len(loop.data["valid"]) == 1


def test_uneven_train_data_on_several_processes_names_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    data = {"train": BatchStream(np.arange(15), batch_size=4, seed=0)}
    with pytest.raises(
        ConfigError, match=r"stream 'train': 15 examples.*2 processes.*\[loop\] uneven_shards = \"drop\""
    ):
        Loop(Recorder(), data, world=World(rank=0, size=2), uneven_shards="error", handle_signals=False)
    capsys.readouterr()
    loop = Loop(Recorder(), data, world=World(rank=0, size=2), handle_signals=False)  # pads by default
    assert len(loop.data["train"]) == 2 and loop.data["train"].remainder == "pad"
    told = capsys.readouterr().err.splitlines()
    assert len(told) == 1 and "15 examples on 2 processes: 1 of them repeated per epoch" in told[0]
    Loop(Recorder(), data, world=World(rank=1, size=2), handle_signals=False)
    assert capsys.readouterr().err == ""  # rank 0 says it, the others do not
    Loop(Recorder(), {"train": BatchStream(np.arange(16), batch_size=4, seed=0)}, world=World(rank=0, size=2))
    assert capsys.readouterr().err == ""  # nothing repeated, nothing said
    with pytest.raises(
        ConfigError, match="Loop\\(\\): uneven_shards must be 'error', 'drop' or 'pad', not 'repeat'"
    ):
        Loop(Recorder(), data, world=World(rank=0, size=2), uneven_shards="repeat", handle_signals=False)  # type: ignore[arg-type]


def test_a_model_without_distribute_on_several_processes_is_a_clear_error() -> None:
    from epochal.examples.tiny import TinyModel, tiny_data

    class Plain(TinyModel):
        distribute = None  # type: ignore[assignment]

    with pytest.raises(ConfigError, match=r"model \(.*Plain\) has no distribute\(world\).*2 processes"):
        Loop(Plain(), tiny_data(), world=World(rank=0, size=2), handle_signals=False)


torch = pytest.importorskip("torch")


def loader(n: int = 30, batch_size: int = 4, **options: Any) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(torch.arange(n)), batch_size=batch_size, **options)


def loader_ids(stream: Any) -> list[list[int]]:
    return [batch[0].tolist() for batch in stream]


@pytest.mark.parametrize("size", [2, 3])
def test_loader_shards_share_one_shuffled_order(size: int) -> None:
    from epochal.torch import LoaderStream

    whole = LoaderStream(loader(30, shuffle=True), seed=5)
    shards = [whole.shard(rank, size, "keep") for rank in range(size)]
    for _ in range(2):
        parts = [flatten(loader_ids(shard)) for shard in shards]
        assert sorted(flatten(parts)) == list(range(30))
        assert all(len(shard) == -(-len(part) // 4) for shard, part in zip(shards, parts))
        interleaved = [parts[i % size][i // size] for i in range(30)]  # rank r took order[r::size]
        assert sorted(interleaved) == list(range(30)) and interleaved != list(range(30))
    expected = {"seed": 5, "epoch": 2, "position": 0, "batches": len(shards[0]), "world_size": size}
    assert shards[0].state_dict() == expected


def test_loader_shard_resumes_mid_epoch_exactly() -> None:
    from epochal.torch import LoaderStream

    straight = loader_ids(LoaderStream(loader(32, shuffle=True), seed=2).shard(1, 2, "error"))
    stream = LoaderStream(loader(32, shuffle=True), seed=2).shard(1, 2, "error")
    iterator = iter(stream)
    next(iterator), next(iterator)
    state = stream.state_dict()
    fresh = LoaderStream(loader(32, shuffle=True), seed=2).shard(1, 2, "error")
    fresh.load_state_dict(state)
    assert loader_ids(fresh) == straight[2:]


def test_uneven_loader_and_unshardable_loaders_are_clear_errors() -> None:
    from torch.utils.data import DataLoader, IterableDataset

    from epochal.torch import LoaderStream

    with pytest.raises(ConfigError, match=r"stream 'train': 30 examples cannot be shared evenly by 4"):
        shard_stream("train", loader(30), 0, 4, "error")
    dropped = shard_stream("train", loader(30, drop_last=True), 3, 4, "drop")
    assert isinstance(dropped, LoaderStream) and len(dropped) == 1 and len(loader_ids(dropped)[0]) == 4

    class Numbers(IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(8))

    with pytest.raises(ConfigError, match="IterableDataset cannot be sharded"):
        shard_stream("train", DataLoader(Numbers(), batch_size=2), 0, 2)


def test_a_custom_batch_sampler_is_sharded_by_whole_batches() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    batches = [[0, 1, 2], [3], [4, 5], [6, 7, 8, 9]]
    data = DataLoader(TensorDataset(torch.arange(10)), batch_sampler=batches)
    parts = [loader_ids(shard_stream("train", data, rank, 2)) for rank in range(2)]
    assert parts == [[[0, 1, 2], [4, 5]], [[3], [6, 7, 8, 9]]]
    with pytest.raises(ConfigError, match="3 batches cannot be shared evenly by 2"):
        shard_stream(
            "train", DataLoader(TensorDataset(torch.arange(10)), batch_sampler=batches[:3]), 0, 2, "error"
        )


def test_a_distributed_sampler_for_this_rank_is_used_as_it_is() -> None:
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    dataset = TensorDataset(torch.arange(12))
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=False)
    stream = shard_stream("train", DataLoader(dataset, batch_size=3, sampler=sampler), 1, 2)
    assert loader_ids(stream) == [[1, 3, 5], [7, 9, 11]]
    with pytest.raises(
        ConfigError, match="DistributedSampler is for rank 1 of 2 processes, but this is rank 0"
    ):
        shard_stream("train", DataLoader(dataset, batch_size=3, sampler=sampler), 0, 2)


def test_worker_seeds_differ_by_rank_and_the_order_does_not() -> None:
    from epochal.torch import LoaderStream

    shards = [LoaderStream(loader(16, shuffle=True), seed=0).shard(rank, 2, "error") for rank in range(2)]
    seeds = []
    for shard in shards:
        shard._prepare(0)
        seeds.append(shard.loader.generator.initial_seed())
        assert (
            shard.loader.sampler.generator.initial_seed() == shards[0].loader.sampler.generator.initial_seed()
        )
    assert seeds[0] != seeds[1]


def test_one_process_array_reduction_is_a_copy() -> None:
    arrays = [np.arange(3, dtype=np.float32), np.ones((2, 2))]
    out = World().all_reduce_arrays(arrays)
    assert [a.dtype for a in out] == [np.float32, np.float64]
    assert all(np.array_equal(a, b) and a is not b for a, b in zip(out, arrays))


@pytest.mark.slow  # DataLoader worker processes
def test_a_loader_shard_with_worker_processes_loads_its_part() -> None:
    from epochal.torch import LoaderStream

    with_workers = LoaderStream(loader(16, shuffle=True, num_workers=1), seed=4).shard(1, 2, "error")
    in_process = LoaderStream(loader(16, shuffle=True), seed=4).shard(1, 2, "error")
    assert loader_ids(with_workers) == loader_ids(in_process)
    assert len(flatten(loader_ids(in_process))) == 8


# -- [loop] shard_order = "distributed_sampler" (issue 30) ----------------------------------------


def _sampler_order(
    n: int, size: int, rank: int, shuffle: bool, seed: int, epoch: int, drop: bool
) -> list[int]:
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(n), size, rank, shuffle=shuffle, seed=seed, drop_last=drop)  # type: ignore[arg-type]
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize(
    ("n", "size", "uneven"), [(16, 2, "error"), (13, 2, "pad"), (13, 3, "drop"), (20, 4, "pad")]
)
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("kind", ["batch_stream", "dataloader"])
def test_distributed_sampler_order_gives_each_rank_what_distributed_sampler_gives_it(
    n: int, size: int, uneven: str, shuffle: bool, kind: str
) -> None:
    pytest.importorskip("torch")
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    for rank in range(size):
        if kind == "batch_stream":
            train: Any = BatchStream(np.arange(n), batch_size=3, shuffle=shuffle, seed=5)
        else:
            train = DataLoader(TensorDataset(torch.arange(n)), batch_size=3, shuffle=shuffle)
        loop = Loop(
            Recorder(), {"train": train}, world=World(rank=rank, size=size), max_epochs=1, seed=5,
            handle_signals=False, uneven_shards=uneven, shard_order="distributed_sampler",  # type: ignore[arg-type]
        )  # fmt: skip
        for epoch in range(3):
            seen = flatten(
                [int(v) for v in np.asarray(b[0] if kind == "dataloader" else b)] for b in loop.data["train"]
            )
            assert seen == _sampler_order(n, size, rank, shuffle, 5, epoch, uneven == "drop"), (rank, epoch)


def test_distributed_sampler_order_on_one_process_is_the_samplers_too() -> None:
    pytest.importorskip("torch")
    loop = Loop(
        Recorder(), {"train": BatchStream(np.arange(10), batch_size=4, seed=2)}, max_epochs=1,
        handle_signals=False, shard_order="distributed_sampler",
    )  # fmt: skip
    for epoch in range(2):
        assert flatten(ids_of(loop.data["train"])) == _sampler_order(10, 1, 0, True, 2, epoch, False)
    epochal_own = BatchStream(np.arange(10), batch_size=4, seed=2)
    assert flatten(ids_of(epochal_own)) != _sampler_order(10, 1, 0, True, 2, 0, False)  # the default differs


def test_distributed_sampler_order_refuses_what_has_no_such_order() -> None:
    pytest.importorskip("torch")
    import torch
    from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

    with pytest.raises(
        ConfigError, match=r"shard_order = \"distributed_sampler\": \[data\] stream 'train' \(list\)"
    ):
        Loop(
            Recorder(), {"train": [np.arange(3)] * 4}, handle_signals=False, shard_order="distributed_sampler"
        )
    weighted = DataLoader(
        TensorDataset(torch.arange(8)), batch_size=2, sampler=WeightedRandomSampler([1.0] * 8, 8)
    )
    with pytest.raises(
        ConfigError, match=r"stream 'train': DistributedSampler's order.*WeightedRandomSampler"
    ):
        Loop(Recorder(), {"train": weighted}, handle_signals=False, shard_order="distributed_sampler")
    with pytest.raises(ConfigError, match="shard_order"):
        Loop(Recorder(), {"train": [np.arange(3)]}, handle_signals=False, shard_order="torch")  # type: ignore[arg-type]
    # an evaluation stream without an order of examples keeps its own
    loop = Loop(
        Recorder(), {"train": BatchStream(np.arange(8), batch_size=4), "valid": [np.arange(3)] * 2},
        handle_signals=False, shard_order="distributed_sampler",
    )  # fmt: skip
    assert len(loop.data["valid"]) == 2


def test_distributed_sampler_order_reaches_the_streams_a_callable_makes() -> None:
    pytest.importorskip("torch")
    loop = Loop(
        Recorder(), {"train": lambda: BatchStream(np.arange(9), batch_size=4, seed=1)}, max_epochs=1,
        handle_signals=False, shard_order="distributed_sampler",
    )  # fmt: skip
    made = loop.data["train"]()
    assert flatten(ids_of(made)) == _sampler_order(9, 1, 0, True, 1, 0, False)


def test_an_unseeded_runs_drawn_order_seed_is_rank_zeros_on_every_rank() -> None:
    from types import SimpleNamespace

    from epochal.adapters import DrawnSeed
    from epochal.distributed.strategy import DistributedStrategy

    sent: list[object] = []

    def broadcast_object(obj: object, src: int = 0) -> object:
        sent.append(obj)
        return 12345  # rank 0's draw, as torch's broadcast gives it to every rank

    other_rank = SimpleNamespace(rank=1, size=2, is_zero=False, broadcast_object=broadcast_object)
    seed = DistributedStrategy(other_rank).order_seed(None)
    assert seed == 12345 and isinstance(seed, DrawnSeed)  # a stream adopts a saved seed over it
    assert sent == [None]  # rank 1 draws nothing of its own
    assert DistributedStrategy(other_rank).order_seed(7) == 7 and len(sent) == 1  # seeded: no collective
