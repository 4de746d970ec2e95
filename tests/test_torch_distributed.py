"""Two processes through torch's launcher: DDP, sharded streams, whole-stream metrics, states.

Every run is ``python -m torch.distributed.run --standalone --nproc-per-node 2 -m epochal run
CONFIG`` (gloo over loopback, CPU), with the recording plugin of ``ddp_probe.py``; each run's
result is compared with a one-process computation made here, in the test process.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchmetrics")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # the processes import ddp_probe from here too (PYTHONPATH)
import ddp_probe  # noqa: E402


def torchrun(
    tmp: Path, config: str, nproc: int = 2, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``epochal run`` of *config* (TOML text) on *nproc* processes started by torch's launcher."""
    path = tmp / "run.toml"
    path.write_text(config)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "EPOCHAL_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command += ["-m", "epochal", "run", str(path)]
    return subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)


def config(
    tmp: Path, model: str = "", data: str = "", probe: str = "", loop: str = "", epochs: int = 2
) -> str:
    return f"""
[loop]
max_epochs = {epochs}
seed = 0
run_dir = "{tmp / "run"}"
{loop}

[model]
factory = "ddp_probe:make_model"
{model}

[data]
factory = "ddp_probe:make_data"
{data}

[plugins]
autoload = false
order = ["probe"]

[plugins.probe]
factory = "ddp_probe:Probe"
dir = "{tmp / "probe"}"
{probe}
"""


def records(tmp: Path, result: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return [pickle.loads((tmp / "probe" / f"rank{r}.pkl").read_bytes()) for r in range(2)]


def rows(batches: list[Any]) -> list[bytes]:
    return [row.tobytes() for x, *_ in batches for row in x]


def assert_same_parameters(ranks: list[dict[str, Any]]) -> None:
    a, b = ranks[0]["params"], ranks[1]["params"]
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name], b[name]), f"{name} differs between the ranks"


def one_process_replica(ranks: list[dict[str, Any]], per_step: int, **model: Any) -> dict[str, np.ndarray]:
    """Train one process on the global batches: rank 0's then rank 1's next *per_step* batches."""
    replica = ddp_probe.make_model(**model)
    steps = len(ranks[0]["train"]) // per_step
    for k in range(steps):
        parts = [r["train"][k * per_step + j] for r in ranks for j in range(per_step)]
        x = np.concatenate([p[0] for p in parts])
        y = np.concatenate([p[1] for p in parts])
        replica.train_step((x, y))
    return ddp_probe.params_of(replica)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """2 processes x 8 examples per batch, DataLoaders, 2 epochs of 4 steps; eval of 21 examples."""
    tmp = tmp_path_factory.mktemp("ddp")
    return tmp, records(tmp, torchrun(tmp, config(tmp)))


def test_both_ranks_hold_bitwise_identical_parameters(ddp_run: Any) -> None:
    _, ranks = ddp_run
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["size"] == 2
    assert ranks[0]["module_class"] == "DistributedDataParallel"
    assert len(ranks[0]["train"]) == len(ranks[1]["train"]) == 8
    assert_same_parameters(ranks)
    assert ranks[0]["allreduces"] == ranks[0]["optimizer_steps"] == 8  # one bucket per step


def test_two_processes_equal_one_process_on_the_concatenated_batches(ddp_run: Any) -> None:
    _, ranks = ddp_run
    expected = one_process_replica(ranks, per_step=1)
    initial = ddp_probe.params_of(ddp_probe.make_model())
    for name, value in ranks[0]["params"].items():
        assert not np.allclose(value, initial[name])  # it trained
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6)


def test_train_shards_are_disjoint_and_cover_each_epoch(ddp_run: Any) -> None:
    _, ranks = ddp_run
    everything = sorted(row.tobytes() for row in ddp_probe.arrays(64, 1)[0])
    for epoch in range(2):
        mine = [rows(r["train"][epoch * 4 : (epoch + 1) * 4]) for r in ranks]
        assert not set(mine[0]) & set(mine[1])
        assert sorted(mine[0] + mine[1]) == everything
    assert rows(ranks[0]["train"][:4]) != rows(ranks[0]["train"][4:])  # a fresh order each epoch


def test_uneven_evaluation_shards_give_whole_stream_metrics(ddp_run: Any) -> None:
    _, ranks = ddp_run
    x, y = ddp_probe.arrays(21, 2)
    seen = [rows(r["valid"]) for r in ranks]
    assert (len(seen[0]), len(seen[1])) == (11, 10)  # no padding: every example once
    assert sorted(seen[0] + seen[1]) == sorted(row.tobytes() for row in x)
    # the batch means, weighted by batch sizes and summed over the ranks, are the whole stream's
    final = ddp_probe.make_model()
    final.load_state_dict(ranks[0]["state"])
    whole = final.eval_step((x, y))
    for key in ("loss", "accuracy"):
        total = sum(v[key] * len(b) for r in ranks for b, _, v in r["valid"])
        assert total / 21 == pytest.approx(float(whole[key]), rel=1e-6, abs=1e-7)
    # torchmetrics' F1 is synced across the ranks: both report the whole stream's, as sklearn does
    from sklearn.metrics import f1_score

    with torch.no_grad():
        predictions = final.raw_module(torch.from_numpy(x)).argmax(dim=1).numpy()
    expected = f1_score(y, predictions, average="macro", labels=list(range(ddp_probe.CLASSES)))
    for r in ranks:
        assert r["metrics"]["valid"]["f1"] == pytest.approx(expected, abs=1e-6)


def test_a_state_of_two_processes_has_the_modules_names_and_loads_on_one(ddp_run: Any) -> None:
    _, ranks = ddp_run
    state = ranks[0]["state"]
    fresh = ddp_probe.make_model(seed=3)
    assert list(state["module"]) == list(fresh.raw_module.state_dict())  # no "module." prefix
    assert fresh.check_state(state) == []
    fresh.load_state_dict(state)
    for name, value in ddp_probe.params_of(fresh).items():
        assert np.array_equal(value, ranks[0]["params"][name])


def test_accumulation_with_no_sync_equals_the_run_without(tmp_path: Path) -> None:
    """Batches of 4, 2 per optimizer step; starts from a one-process state loaded on both ranks."""
    start = ddp_probe.make_model(seed=5)
    start.train_step(ddp_probe.arrays(8, 9))
    (tmp_path / "start.pkl").write_bytes(pickle.dumps(start.state_dict()))
    text = config(
        tmp_path,
        model="accumulate_grad_batches = 2",
        data="batch_size = 4",
        probe=f'load_from = "{tmp_path / "start.pkl"}"\ngrab_mid_window = true',
    )
    ranks = records(tmp_path, torchrun(tmp_path, text))
    assert len(ranks[0]["train"]) == 16 and ranks[0]["optimizer_steps"] == 9  # 8 here, 1 before
    assert ranks[0]["allreduces"] == 8  # gradients all-reduced only on the steps of the optimizer
    assert_same_parameters(ranks)
    replica = ddp_probe.make_model(seed=5)
    replica.load_state_dict(start.state_dict())
    expected = one_process_replica_from(replica, ranks)
    for name, value in ranks[0]["params"].items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6)
    # inside a window the state holds each rank's own gradients, the same state on both ranks
    mid = [r["mid_window"] for r in ranks]
    grads = mid[0]["steps"]["rank_grads"]
    assert len(grads) == 2 and not np.array_equal(grads[0]["0.weight"], grads[1]["0.weight"])
    for a, b in zip(grads, mid[1]["steps"]["rank_grads"]):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    (problem,) = ddp_probe.make_model(accumulate_grad_batches=2).check_state(mid[0])
    assert "accumulation window on 2 process(es)" in problem and "resume on 2" in problem


def one_process_replica_from(replica: Any, ranks: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    for k in range(0, len(ranks[0]["train"]), 2):
        parts = [r["train"][k + j] for r in ranks for j in range(2)]
        replica.train_step((np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])))
    return ddp_probe.params_of(replica)


def test_uneven_train_data_is_one_clear_error_before_training(tmp_path: Path) -> None:
    result = torchrun(tmp_path, config(tmp_path, data="n_train = 63", loop='uneven_shards = "error"'))
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "[data] stream 'train': 63 examples cannot be shared evenly by 2 processes" in output
    # one line per rank at most: under torchrun the first rank to fail makes torchrun stop the other,
    # which may or may not have printed its line by then
    assert output.count('[loop] uneven_shards = "drop"') in (1, 2)
    assert "[rank0]: Traceback" not in output and "[rank1]: Traceback" not in output
    assert not (tmp_path / "probe").exists()
    # the same data with uneven_shards = "drop" trains
    ranks = records(
        tmp_path, torchrun(tmp_path, config(tmp_path, data="n_train = 63", loop='uneven_shards = "drop"'))
    )
    assert len(ranks[0]["train"]) == len(ranks[1]["train"]) == 8
    assert_same_parameters(ranks)


def test_a_compiled_module_trains_under_ddp(tmp_path: Path) -> None:
    text = config(
        tmp_path, model='compile = "aot_eager"\nplain_metric = true', data="loader = false", epochs=1
    )
    result = torchrun(tmp_path, text)
    ranks = records(tmp_path, result)
    # a metric object that cannot sync is computed over each rank's shard, and the run says so
    assert result.stderr.count("TorchModel metric 'count' (Count) has no sync()") == 2
    assert [r["metrics"]["valid"]["count"] for r in ranks] == [11, 10]
    assert_same_parameters(ranks)
    state = ranks[0]["state"]
    assert list(state["module"]) == list(ddp_probe.make_model().raw_module.state_dict())
    expected = one_process_replica(ranks, per_step=1)
    for name, value in ranks[0]["params"].items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6)


def test_the_numpy_example_model_trains_on_two_processes(tmp_path: Path) -> None:
    text = config(tmp_path, data="batch_size = 32").replace(
        "ddp_probe:make_model", "epochal.examples.digits:make_model"
    )
    text = text.replace("ddp_probe:make_data", "epochal.examples.digits:make_data")
    ranks = records(tmp_path, torchrun(tmp_path, text))
    assert_same_parameters(ranks)
    assert len(ranks[0]["train"]) == 2 * 23  # 1,438 training images: 719 a rank, 23 batches of 32
    from epochal.examples.digits import make_model

    replica = make_model()
    for k in range(len(ranks[0]["train"])):
        parts = [r["train"][k] for r in ranks]
        replica.train_step((np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])))
    for name, value in replica.state_dict().items():
        np.testing.assert_allclose(ranks[0]["params"][name], value, rtol=1e-4, atol=1e-6)
    assert ranks[0]["metrics"]["valid"]["accuracy"] > 0.8


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)
def test_nccl_on_two_gpus_trains_like_one_process(tmp_path: Path) -> None:
    """The backend is NCCL (chosen for CUDA); each rank's module sits on cuda:LOCAL_RANK."""
    ranks = records(tmp_path, torchrun(tmp_path, config(tmp_path, model='device = "auto"')))
    assert_same_parameters(ranks)
    expected = one_process_replica(ranks, per_step=1)
    for name, value in ranks[0]["params"].items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-4, atol=1e-5)
    assert ranks[0]["metrics"]["valid"]["f1"] == ranks[1]["metrics"]["valid"]["f1"]
