"""``epochal.torch.full_weights``: a model's full weights on rank 0, for a plugin (issue 46, item 5).

Under FSDP reading a parameter whole is an all-gather every rank must join; the helper is called
on every rank and gives rank 0 the weights. Checked on 2 gloo processes against the full state
the run's own recording plugin gathers, and on one process against the module's state.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import fsdp_mlp  # noqa: E402
from epochal.testing import epochal_command  # noqa: E402
from epochal.torch import TorchModel, full_weights  # noqa: E402


def test_on_one_process_the_weights_are_the_modules_own_state() -> None:
    model = fsdp_mlp.make_model()
    weights = full_weights(model)
    assert weights is not None
    expected = model.raw_module.state_dict()
    assert weights.keys() == expected.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, expected[name]) and tensor.device.type == "cpu"
        assert tensor.data_ptr() != expected[name].data_ptr()  # a copy: training goes on
    compiled = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert full_weights(torch.compile(compiled)).keys() == {"0.weight", "0.bias"}  # type: ignore[union-attr]
    with pytest.raises(TypeError, match=r"TorchModel or a torch\.nn\.Module, not dict"):
        full_weights({})


def test_several_modules_come_under_their_names() -> None:
    modules = {"a": torch.nn.Linear(2, 3), "b": torch.nn.Linear(3, 1)}
    params = [p for m in modules.values() for p in m.parameters()]

    def step(model: Any, batch: Any) -> dict[str, Any]:
        loss = model.modules["b"](model.modules["a"](batch[0])).pow(2).mean()
        model.backward(loss)
        return {"loss": loss}

    model = TorchModel(modules, torch.optim.SGD(params, lr=0.1), training_step=step, device="cpu")
    assert set(full_weights(model) or {}) == {"a.weight", "a.bias", "b.weight", "b.bias"}


@pytest.mark.slow
@pytest.mark.distributed
def test_under_fsdp_every_rank_calls_it_and_rank_0_gets_the_full_weights(tmp_path: Path) -> None:
    config = fsdp_mlp.write_config(tmp_path, "fsdp")
    shutil.copy(HERE / "full_weights_probe.py", tmp_path / "full_weights_probe.py")
    text = config.read_text().replace(
        'order = ["checkpoint", "record"]', 'order = ["checkpoint", "weights", "record"]'
    )
    config.write_text(text + '\n[plugins.weights]\nfactory = "full_weights_probe:Weights"\n')
    done = epochal_command(
        "run", str(config), "--nproc", "2", cwd=tmp_path, env={"OMP_NUM_THREADS": "1"}, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    ranks: list[dict[str, Any]] = [json.loads((tmp_path / f"weights-{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["sharded"] is ranks[1]["sharded"] is True
    assert ranks[1]["got"] == [None, None]  # both epochs: the other ranks joined, and got nothing
    first, last = ranks[0]["got"]
    assert first is not None and last is not None and first != last
    assert [len(last["0.weight"]), len(last["0.weight"][0])] == [32, fsdp_mlp.FEATURES]  # whole, not 16 rows
    record = json.loads((tmp_path / "record.json").read_text())  # the final state, gathered by the loop
    assert last == record["module"]
