"""Loaders and datasets with a state of their own resume from it (issue 46, item 4).

torchdata's ``StatefulDataLoader`` (with and without workers, over a streamed dataset or a
map-style one) and a Hugging Face streaming ``IterableDataset`` (alone, or in a torch
``DataLoader``) read the jsonl files each test writes (no download). A resumed stream yields
the rest of the straight run's epoch and then its next epochs, reads only what is left, leaves
torch's generator where the checkpoint left it, and refuses a state of other data in one line
naming the stream. Through the CLI: kill -9 and ``--resume``, ``epochal check-resume`` on 1 and
2 processes.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchdata")
pytest.importorskip("datasets")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import stateful_data  # noqa: E402
from epochal import Loop  # noqa: E402
from epochal.adapters import adapt_stream  # noqa: E402
from epochal.errors import StreamStateError  # noqa: E402
from epochal.stateful import StatefulStream  # noqa: E402
from epochal.testing import epochal_command  # noqa: E402
from epochal.torch import LoaderStream  # noqa: E402

KINDS = ["dataset", "loader", "dataloader", "map"]


@pytest.fixture(autouse=True)
def _offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


@pytest.fixture
def files(tmp_path: Path) -> str:
    stateful_data.write_files(tmp_path / "files")
    return str(tmp_path / "files")


def stream(directory: str, kind: str, **options: Any) -> Any:
    return adapt_stream(stateful_data.make_data(directory, kind, **options)["train"], 0, "train")


def values(batch: Any) -> list[float]:
    y = batch["y"] if isinstance(batch, dict) else batch[1]
    return [round(float(v), 12) for v in y]


def test_the_loop_wraps_the_stateful_sources_and_leaves_a_plain_dataloader_to_loaderstream(
    files: str,
) -> None:
    for kind in ("dataset", "loader", "map"):
        assert isinstance(stream(files, kind), StatefulStream), kind
    assert isinstance(stream(files, "dataloader"), LoaderStream)


@pytest.mark.parametrize("kind", KINDS)
def test_a_resumed_stream_yields_the_rest_of_the_epoch_then_the_next_ones(files: str, kind: str) -> None:
    torch.manual_seed(0)
    straight = stream(files, kind)
    epochs = []
    for _ in range(2):
        epochs.append([values(b) for b in straight])
    after = torch.rand(4)  # where the straight run's generator is after its epochs

    torch.manual_seed(0)
    first = stream(files, kind)
    head, iterator = [], iter(first)
    for _ in range(6):
        head.append(values(next(iterator)))
    saved, rng = first.state_dict(), torch.get_rng_state()
    del iterator

    torch.manual_seed(123)  # another run: its generator and its stream start elsewhere
    resumed = stream(files, kind)
    resumed.load_state_dict(saved)
    torch.set_rng_state(rng)  # the loop restores the generator after the streams
    rest = [values(b) for b in resumed]
    assert head + rest == epochs[0]
    assert [values(b) for b in resumed] == epochs[1]  # the next epoch from its start
    assert torch.equal(torch.rand(4), after), "the resumed pass moved torch's global generator"
    assert len(epochs[0]) == 16 and saved["position"] == 6


@pytest.mark.parametrize("kind", ["dataset", "dataloader"])
def test_a_resume_reads_only_the_rest_of_the_epoch(files: str, kind: str) -> None:
    """The examples the pipeline reads after a resume at batch 12 of 16: those of the last 4
    batches, and at most the file it was in again (Hugging Face goes back to the start of the
    chunk it was reading), not the 48 before them (a stream without a state replays them)."""
    read: list[int] = []

    def counted(example: dict[str, Any]) -> dict[str, Any]:
        read.append(1)
        return example

    def make() -> Any:
        dataset = stateful_data.streaming(files).map(counted)
        if kind == "dataset":
            return adapt_stream(dataset.batch(4), 0, "train")
        loader = torch.utils.data.DataLoader(dataset, 4, collate_fn=stateful_data.pairs)
        return adapt_stream(loader, 0, "train")

    first = make()
    iterator = iter(first)
    for _ in range(12):
        next(iterator)
    saved = first.state_dict()
    del iterator
    resumed = make()
    resumed.load_state_dict(saved)
    read.clear()
    assert len(list(resumed)) == 4
    assert 16 <= len(read) < 16 + stateful_data.ROWS


def test_a_state_of_other_files_is_refused_in_one_line_naming_the_stream(files: str) -> None:
    first = stream(files, "loader")
    iterator = iter(first)
    for _ in range(3):
        next(iterator)
    saved = first.state_dict()
    del iterator
    fewer = stream(files, "loader", files=3)
    with pytest.raises(StreamStateError) as raised:
        fewer.load_state_dict(saved)
    message = str(raised.value)
    assert "[data] stream 'train' (StatefulDataLoader)" in message and "\n" not in message
    assert "saved with 4 dataset shards (files), now 3" in message
    with pytest.raises(StreamStateError, match="saved with 0 workers, now 2"):
        stream(files, "loader", workers=2).load_state_dict(saved)
    with pytest.raises(StreamStateError, match="saved from the pipeline RebatchedArrowExamplesIterable"):
        shuffled = stateful_data.streaming(files).shuffle(seed=0, buffer_size=8)
        adapt_stream(shuffled, 0, "train").load_state_dict({**saved, "source": "IterableDataset"})


def test_a_state_saved_at_an_epoch_end_continues_on_other_data(files: str) -> None:
    first = stream(files, "loader")
    assert len(list(first)) == 16
    fewer = stream(files, "loader", files=3)
    fewer.load_state_dict(first.state_dict())
    assert len(list(fewer)) == 12 and fewer.state_dict()["epoch"] == 2


def test_the_loop_names_the_stream_of_a_state_that_does_not_fit(files: str) -> None:
    def loop(count: int) -> Loop:
        return Loop(stateful_data.make_model(), stateful_data.make_data(files, files=count), max_epochs=1)

    first = loop(4)
    iterator = iter(first.data["train"])
    next(iterator)
    state = first.state_dict()
    state["in_epoch"], state["batch_in_epoch"] = True, 1
    with pytest.raises(StreamStateError, match=r"\[data\] stream 'train' .* now 3"):
        loop(3).load_state_dict(state)


def test_a_sharded_dataset_gives_each_rank_its_files(files: str) -> None:
    whole = stream(files, "loader")
    parts = [whole.shard(rank, 2) for rank in range(2)]
    seen = [[v for b in part for v in values(b)] for part in parts]
    assert len(seen[0]) == len(seen[1]) == 32
    assert sorted(seen[0] + seen[1]) == sorted(v for b in stream(files, "loader") for v in values(b))
    assert parts[0].state_dict()["world_size"] == 2
    with pytest.raises(ValueError, match="sampler=DistributedSampler"):
        stream(files, "map").shard(0, 2)


# -- through the CLI ----------------------------------------------------------------------------


def run(directory: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {"OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(directory / "hf")}
    return epochal_command(*args, cwd=directory, env=env, timeout=timeout)


def record(directory: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((directory / "record.json").read_text())
    return result


def setup(directory: Path, data: str, **options: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    stateful_data.write_files(directory / "files")
    return stateful_data.write_config(directory, data, **options)


KILL = ', "kill"\n[plugins.kill]\nfactory = "stateful_data:KillAt"\nbatch = 21\n'


@pytest.mark.slow
def test_a_run_killed_inside_an_epoch_resumes_as_the_straight_run(tmp_path: Path) -> None:
    """A StatefulDataLoader with 2 workers over the streamed files: kill -9 after batch 21 (5 of
    epoch 2), then ``--resume``: the weights and every target seen are the straight run's."""
    data = 'kind = "loader"\nworkers = 2'
    straight = setup(tmp_path / "straight", data)
    done = run(tmp_path / "straight", "run", str(straight))
    assert done.returncode == 0, done.stderr[-3000:]
    killed = setup(tmp_path / "killed", data, plugins=KILL)
    done = run(tmp_path / "killed", "run", str(killed))
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    done = run(tmp_path / "killed", "run", str(killed), "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed" in done.stdout + done.stderr
    assert record(tmp_path / "killed") == record(tmp_path / "straight")
    assert record(tmp_path / "straight")["iteration"] == 32


@pytest.mark.slow
def test_a_resume_on_other_files_is_one_line_naming_the_stream(tmp_path: Path) -> None:
    config = setup(tmp_path, 'kind = "dataset"', plugins=KILL)
    assert run(tmp_path, "run", str(config)).returncode == -signal.SIGKILL
    done = run(tmp_path, "run", str(config), "--resume", "--set", "data.files=3")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "[data] stream 'train'" in line]
    assert "saved with 4 dataset shards (files), now 3" in line


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dataset", "map"])
def test_check_resume_passes_on_one_process(tmp_path: Path, kind: str) -> None:
    config = setup(tmp_path, f'kind = "{kind}"')
    done = run(tmp_path, "check-resume", str(config), "--at", "21")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ok: interrupted after batch 21 of 32 and resumed" in done.stdout


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["loader", "map"])
def test_check_resume_passes_on_two_processes(tmp_path: Path, kind: str) -> None:
    """Each rank its files (split_dataset_by_node) or its StatefulDistributedSampler: stopped after
    batch 11 (3 of epoch 2), resumed, bitwise the straight run on every rank."""
    config = setup(tmp_path, f'kind = "{kind}"')
    done = run(tmp_path, "check-resume", str(config), "--nproc", "2", "--at", "11")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ok: interrupted after batch 11 of 16 and resumed" in done.stdout
