"""A training step of the user's own: own loss, batches without targets, several modules and
optimizers, manual optimization; each against a plain PyTorch loop doing the same, bitwise.

One process, in the test process (``test_torch_own_step_cli.py`` runs them through the CLI, on
two processes, through kill -9 and check-resume).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from epochal_monitor import Monitor  # noqa: E402

from epochal import ConfigError, Loop, hookimpl  # noqa: E402
from epochal.torch import TorchModel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import own_step_models as models  # noqa: E402


def same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Bitwise equal parameters and buffers."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def real_batches(count: int = 5, seed: int = 1) -> list[torch.Tensor]:
    data = models.real_examples(8 * count, seed)
    return [torch.from_numpy(data[i * 8 : (i + 1) * 8]) for i in range(count)]


def train(model: Any, batches: list[Any], epochs: int = 1, plugins: Any = None, **data: Any) -> Loop:
    loop = Loop(model, {"train": batches, **data}, plugins=plugins or {}, max_epochs=epochs)
    loop.run()
    return loop


# -- manual optimization: a GAN ----------------------------------------------------------------


def test_a_gan_under_manual_optimization_equals_the_hand_written_loop() -> None:
    batches = real_batches()
    model = models.make_gan()
    torch.manual_seed(11)
    loop = train(model, batches, plugins={"monitor": Monitor()})
    torch.manual_seed(11)
    hand = models.hand_gan(batches)
    same(model.modules["generator"], hand["generator"])
    same(model.modules["discriminator"], hand["discriminator"])
    assert model.optimizer_steps == 5 and model.stepped_optimizers == {"generator", "discriminator"}
    # each returned value is logged as the epoch's mean
    assert loop.log.last("train.loss_d") is not None and loop.log.last("train.loss_g") is not None


class Lightning(TorchModel):
    """The same GAN as a LightningModule is written: methods of a subclass."""

    automatic_optimization = False

    def __init__(self) -> None:
        generator, discriminator = models.gan_modules()
        super().__init__(
            {"generator": generator, "discriminator": discriminator},
            models.gan_optimizers(generator, discriminator),
            device="cpu",
        )

    def training_step(self, batch: Any) -> Any:
        return models.gan_step(self, batch)

    def validation_step(self, batch: Any) -> Any:
        return models.gan_eval(self, batch)


def test_the_subclass_form_trains_as_the_function_form() -> None:
    batches = real_batches(3)
    torch.manual_seed(5)
    functions = models.make_gan()
    train(functions, batches, valid=real_batches(2, seed=9))
    torch.manual_seed(5)
    methods = Lightning()
    loop = train(methods, batches, valid=real_batches(2, seed=9))
    same(functions.raw_module, methods.raw_module)
    assert loop.log.last("valid.d_real") is not None and loop.log.last("valid.loss") is not None


def test_16_mixed_scales_each_optimizer_and_updates_once_per_batch() -> None:
    """torch's recipe for several optimizers: scale each loss, step each through the scaler,
    one update per iteration."""
    batches = real_batches(4)
    model = models.make_gan(precision="16-mixed")
    torch.manual_seed(3)
    train(model, batches)
    torch.manual_seed(3)
    generator, discriminator = models.gan_modules()
    optimizers = models.gan_optimizers(generator, discriminator)
    scaler = torch.amp.GradScaler("cpu")
    for real in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            models.gan_losses(
                generator,
                discriminator,
                real,
                lambda loss: scaler.scale(loss).backward(),
                lambda n: (scaler.unscale_(optimizers[n]), scaler.step(optimizers[n])),
            )
        scaler.update()
    same(model.modules["generator"], generator)
    same(model.modules["discriminator"], discriminator)
    assert model.precision.scaler.get_scale() == scaler.get_scale()


def test_before_optimizer_step_and_clipping_apply_to_each_optimizer() -> None:
    seen: list[tuple[int, Any]] = []

    class Hook:
        @hookimpl
        def before_optimizer_step(self, loop: Any, optimizer: Any) -> None:
            seen.append((loop.iteration, optimizer))

    batches = real_batches(2)
    model = models.make_gan(gradient_clip_val=0.01)
    torch.manual_seed(2)
    train(model, batches, plugins={"hook": Hook()})
    optimizers = model.optimizers
    assert seen == [
        (0, optimizers["discriminator"]),
        (0, optimizers["generator"]),
        (1, optimizers["discriminator"]),
        (1, optimizers["generator"]),
    ]
    torch.manual_seed(2)
    generator, discriminator = models.gan_modules()
    hand = models.gan_optimizers(generator, discriminator)

    def step(name: str) -> None:
        params = [p for g in hand[name].param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, 0.01)
        hand[name].step()

    for real in batches:
        models.gan_losses(generator, discriminator, real, lambda loss: loss.backward(), step)
    same(model.modules["generator"], generator)


def test_a_state_taken_between_batches_resumes_bitwise_with_the_gradients_a_step_left() -> None:
    """The generator's loss leaves gradients in the discriminator after its step: a state holds
    them, so a run resumed there continues as the straight one."""
    batches = real_batches(6)
    straight = models.make_gan()
    torch.manual_seed(7)
    loop = Loop(straight, {"train": batches[:3]}, plugins={}, max_epochs=1)
    loop.run()
    state = copy.deepcopy(straight.state_dict())
    rng = torch.get_rng_state()
    assert set(state) == {"module", "optimizers", "steps"}
    assert set(state["optimizers"]) == {"generator", "discriminator"}
    assert "generator.0.weight" in state["module"] and "discriminator.3.running_mean" in state["module"]
    assert any(k.startswith("discriminator.") for k in state["steps"]["grads"])
    train(straight, batches[3:])
    resumed = models.make_gan(seed=99)  # other weights: all of them come from the state
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)
    train(resumed, batches[3:])
    same(straight.raw_module, resumed.raw_module)
    for name in ("generator", "discriminator"):
        a, b = straight.optimizers[name].state_dict()["state"], resumed.optimizers[name].state_dict()["state"]
        for pid in a:
            for key in a[pid]:
                assert torch.equal(a[pid][key], b[pid][key])


def test_a_state_of_two_optimizers_does_not_load_into_other_optimizers() -> None:
    state = models.make_gan().state_dict()
    state["optimizers"]["critic"] = state["optimizers"].pop("discriminator")
    with pytest.raises(
        ValueError,
        match=r"missing keys \['optimizers.discriminator'\].*unexpected keys \['optimizers.critic'\]",
    ):
        models.make_gan().load_state_dict(state)


def test_per_optimizer_schedules_step_after_their_own_optimizer() -> None:
    """Manual optimization where the generator steps every second batch (a critic trained more
    often): each schedule counts its own optimizer's steps."""
    from epochal_schedule import LRScheduler

    def step(model: TorchModel, batch: Any) -> dict[str, Any]:
        real = batch
        d = model.modules["discriminator"]
        d.zero_grad()
        model.backward(torch.nn.functional.binary_cross_entropy(d(real), torch.ones(real.shape[0])))
        model.optimizer_step("discriminator")
        if model.loop.iteration % 2 == 1:
            g = model.modules["generator"]
            g.zero_grad()
            fake = g(torch.randn(real.shape[0], models.NZ))
            model.backward(torch.nn.functional.binary_cross_entropy(d(fake), torch.ones(real.shape[0])))
            model.optimizer_step("generator")
        return {}

    generator, discriminator = models.gan_modules()
    model = TorchModel(
        {"generator": generator, "discriminator": discriminator},
        models.gan_optimizers(generator, discriminator, lr=1.0),
        training_step=step,
        automatic_optimization=False,
        device="cpu",
    )
    scheduler = LRScheduler("StepLR", interval="batch", step_size=1, gamma=0.5)
    loop = train(model, real_batches(4), plugins={"lr_scheduler": scheduler})
    assert model.optimizers["discriminator"].param_groups[0]["lr"] == pytest.approx(0.5**4)
    assert model.optimizers["generator"].param_groups[0]["lr"] == pytest.approx(0.5**2)
    assert [v for _, v in loop.log.history("lr.generator")] == pytest.approx([1.0, 0.5])
    only = LRScheduler("StepLR", step_size=1, gamma=0.5, optimizer="generator")
    generator, discriminator = models.gan_modules()
    other = models.make_gan(lr=1.0)
    train(other, real_batches(2), epochs=2, plugins={"lr_scheduler": only})
    assert other.optimizers["generator"].param_groups[0]["lr"] == pytest.approx(0.25)
    assert other.optimizers["discriminator"].param_groups[0]["lr"] == 1.0


# -- automatic optimization ---------------------------------------------------------------------


def test_a_model_that_computes_its_own_loss_from_a_dict_batch_equals_the_plain_loop() -> None:
    batches = models.token_batches(4)
    model = models.make_lm(accumulate_grad_batches=2, gradient_clip_val=0.5)
    torch.manual_seed(1)
    train(model, batches, epochs=2, valid=models.token_batches(2, seed=5))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = models.TinyCausalLM()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    torch.manual_seed(1)
    for _ in range(2):
        for i, batch in enumerate(batches):
            net.train()
            (net(**batch).loss / 2).backward()
            if i % 2 == 1:
                torch.nn.utils.clip_grad_norm_(list(net.parameters()), 0.5)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        net.eval()
        with torch.no_grad():  # evaluation: the same step under no_grad, in eval mode
            for batch in models.token_batches(2, seed=5):
                net(**batch)
    same(model.module, net)
    assert model.optimizer_steps == 4


def test_a_batch_without_targets_trains_with_a_self_supervised_loss() -> None:
    """An autoencoder's batch is the inputs alone; the loss compares the reconstruction."""

    def step(model: TorchModel, batch: Any) -> Any:
        return torch.nn.functional.mse_loss(model.module(batch), batch)

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 2), torch.nn.Linear(2, 6))
    hand = copy.deepcopy(net)
    model = TorchModel(net, torch.optim.SGD(net.parameters(), lr=0.1), training_step=step, device="cpu")
    batches = real_batches(3)
    loop = train(model, batches, valid=batches[:1])
    optimizer = torch.optim.SGD(hand.parameters(), lr=0.1)
    for batch in batches:
        torch.nn.functional.mse_loss(hand(batch), batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    same(net, hand)
    assert loop.log.last("valid.loss") == pytest.approx(
        float(torch.nn.functional.mse_loss(hand(batches[0]), batches[0]))
    )


def encoder_and_head(**options: Any) -> tuple[TorchModel, tuple[Any, Any], dict[str, Any], list[Any]]:
    """A model of two modules with an optimizer each (SGD, Adam) and one loss; copies of the
    modules and their optimizers for a hand loop; the batches."""
    torch.manual_seed(0)
    encoder, head = torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)
    hand = copy.deepcopy((encoder, head))

    def optimizers(a: torch.nn.Module, b: torch.nn.Module) -> dict[str, Any]:
        return {"encoder": torch.optim.SGD(a.parameters(), lr=0.5), "head": torch.optim.Adam(b.parameters())}

    def step(model: TorchModel, batch: Any) -> Any:
        x, y = batch
        return torch.nn.functional.cross_entropy(model.modules["head"](model.modules["encoder"](x)), y)

    model = TorchModel(
        {"encoder": encoder, "head": head},
        optimizers(encoder, head),
        training_step=step,
        device="cpu",
        **options,
    )
    generator = torch.Generator().manual_seed(3)
    batches = [
        (torch.randn(8, 5, generator=generator), torch.randint(0, 3, (8,), generator=generator))
        for _ in range(4)
    ]
    return model, hand, optimizers(*hand), batches


def test_two_optimizers_under_automatic_optimization_each_step_after_one_backward() -> None:
    model, hand, hand_optimizers, batches = encoder_and_head()
    train(model, batches)
    for x, y in batches:
        torch.nn.functional.cross_entropy(hand[1](hand[0](x)), y).backward()
        for optimizer in hand_optimizers.values():
            optimizer.step()
            optimizer.zero_grad()
    same(model.modules["encoder"], hand[0])
    same(model.modules["head"], hand[1])
    assert model.stepped_optimizers == {"encoder", "head"}


def test_a_frozen_teacher_runs_in_eval_mode_and_is_not_trained() -> None:
    teacher, student = models.distill_modules()
    frozen = copy.deepcopy(teacher.state_dict())
    hand_teacher, hand_student = copy.deepcopy(teacher), copy.deepcopy(student)
    model = TorchModel(
        {"teacher": teacher, "student": student},
        {"student": torch.optim.SGD(student.parameters(), lr=0.1)},
        training_step=models.distill_step,
        device="cpu",
    )
    assert model.parts.frozen == ["teacher"] and model.parts.trained == ["student"]
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(8, 5, generator=generator), torch.randint(0, 3, (8,), generator=generator))
        for _ in range(3)
    ]
    torch.manual_seed(4)
    loop = train(model, batches, plugins={"monitor": Monitor()})
    assert not teacher.training and student.training
    for key, value in teacher.state_dict().items():
        assert torch.equal(value, frozen[key])
    torch.manual_seed(4)
    hand_teacher.eval()
    optimizer = torch.optim.SGD(hand_student.parameters(), lr=0.1)
    for batch in batches:
        models.distill_step(
            type("M", (), {"modules": {"teacher": hand_teacher, "student": hand_student}})(), batch
        )["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    same(student, hand_student)
    assert loop.log.last("train.hard") is not None


def test_an_own_step_costs_the_same_guarantees_as_the_built_in_one() -> None:
    """The built-in loss_fn step and a step of your own computing the same loss train the same
    weights bitwise, with accumulation, clipping and bf16 autocast."""
    generator = torch.Generator().manual_seed(2)
    batches = [
        (torch.randn(8, 5, generator=generator), torch.randint(0, 3, (8,), generator=generator))
        for _ in range(5)
    ]
    options = {
        "accumulate_grad_batches": 2,
        "gradient_clip_val": 0.3,
        "precision": "bf16-mixed",
        "device": "cpu",
    }

    def made(**step: Any) -> TorchModel:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        return TorchModel(net, torch.optim.Adam(net.parameters()), **step, **options)

    def step(model: TorchModel, batch: Any) -> Any:
        x, y = batch
        return torch.nn.functional.cross_entropy(model.module(x), y)

    built_in = made(loss_fn=torch.nn.functional.cross_entropy)
    own = made(training_step=step)
    train(built_in, batches)
    train(own, batches)
    same(built_in.module, own.module)


def test_evaluation_metric_objects_are_updated_by_the_own_validation_step() -> None:
    class Mean:
        def __init__(self) -> None:
            self.reset()

        def reset(self) -> None:
            self.values: list[float] = []

        def update(self, value: torch.Tensor) -> None:
            self.values.append(float(value))

        def compute(self) -> float:
            return sum(self.values) / len(self.values)

    def validate(model: TorchModel, batch: Any) -> dict[str, Any]:
        model.metrics["mean_score"].update(model.module(batch).mean())
        return {}

    def step(model: TorchModel, batch: Any) -> Any:
        return model.module(batch).pow(2).mean()

    net = torch.nn.Linear(6, 1)
    model = TorchModel(
        net,
        torch.optim.SGD(net.parameters(), lr=0.0),
        metrics={"mean_score": Mean()},
        training_step=step,
        validation_step=validate,
        device="cpu",
    )
    batches = real_batches(2)
    loop = train(model, batches, valid=batches)
    with torch.no_grad():
        expected = np.mean([float(net(b).mean()) for b in batches])
    assert loop.log.last("valid.mean_score") == pytest.approx(expected)


# -- bad input ------------------------------------------------------------------------------------


def linear() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    net = torch.nn.Linear(6, 1)
    return net, torch.optim.SGD(net.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (lambda out: None, r"training_step returned NoneType: return the loss tensor, or a mapping"),
        (
            lambda out: {"mse": out.pow(2).mean()},
            r"training_step returned a mapping without 'loss' \(keys: mse\)",
        ),
        (
            lambda out: out.pow(2),
            r"training_step returned 'loss' as a tensor of shape \[8, 1\]: a logged value must be a scalar",
        ),
        (
            lambda out: out.pow(2).mean().detach(),
            r"training_step returned a loss that does not require gradients",
        ),
        (lambda out: {"loss": 0.5}, r"training_step returned loss 0.5: the loss must be a scalar tensor"),
    ],
)
def test_a_step_that_returns_no_usable_loss_is_one_error_at_the_first_batch(
    returned: Any, message: str
) -> None:
    net, optimizer = linear()
    model = TorchModel(net, optimizer, training_step=lambda m, b: returned(m.module(b)), device="cpu")
    with pytest.raises(ConfigError, match=r"^TorchModel " + message):
        train(model, real_batches(2))
    assert model.optimizer_steps == 0


def bad_combinations(net: torch.nn.Module, optimizer: Any) -> list[tuple[dict[str, Any], str]]:
    """``(constructor arguments changed, the error's words)`` for a model of *net* and
    *optimizer*: one case per refusal."""
    other = torch.nn.Linear(2, 2)
    mse = torch.nn.functional.mse_loss
    step = models.lm_step
    return [
        (
            {"optimizer": torch.optim.SGD(other.parameters(), lr=0.1)},
            r"optimizer 'optimizer' holds a tensor of shape \[2, 2\] that is no parameter of the "
            r"module\(s\) 'module'",
        ),
        ({"module": {"a": net, "b": other}, "loss_fn": mse}, r"with several modules needs a training_step"),
        (
            {"training_step": models.gan_step, "automatic_optimization": False, "accumulate_grad_batches": 2},
            r"accumulate_grad_batches=2 with automatic_optimization=False",
        ),
        (
            {"loss_fn": mse, "automatic_optimization": False},
            r"automatic_optimization=False needs a training_step",
        ),
        (
            {"training_step": step, "metrics": {"acc": lambda o, t: 0.0}},
            r"metrics 'acc': a metric function takes \(outputs, targets\)",
        ),
        ({"module": {"a.b": net}}, r"module: 'a.b' is not a name"),
        (
            {"optimizer": {"one": optimizer, "two": optimizer}, "training_step": step},
            r"'two' is optimizer 'one' again",
        ),
        ({"training_step": "not callable"}, r"training_step must be a function \(model, batch\)"),
        ({"optimizer": torch.optim.LBFGS(net.parameters()), "training_step": step}, r"LBFGS needs a closure"),
    ]


def test_bad_combinations_are_refused_when_the_model_is_made() -> None:
    net, optimizer = linear()
    for change, message in bad_combinations(net, optimizer):
        arguments: dict[str, Any] = {"module": net, "optimizer": optimizer, **change}
        with pytest.raises(ConfigError, match=message):
            TorchModel(arguments.pop("module"), arguments.pop("optimizer"), device="cpu", **arguments)
    # the subclass's own method and an argument: one or the other
    generator, discriminator = models.gan_modules()
    with pytest.raises(
        ConfigError, match=r"training_step: Lightning defines the method training_step already"
    ):
        TorchModel.__init__(
            Lightning.__new__(Lightning),
            {"generator": generator, "discriminator": discriminator},
            models.gan_optimizers(generator, discriminator),
            training_step=models.gan_step,
        )


def test_manual_calls_are_refused_where_they_do_not_belong() -> None:
    net, optimizer = linear()
    automatic = TorchModel(
        net,
        optimizer,
        training_step=lambda m, b: (m.backward(m.module(b).sum()), m.module(b).sum())[1],
        device="cpu",
    )
    with pytest.raises(ConfigError, match=r"TorchModel.backward\(\) is for automatic_optimization=False"):
        train(automatic, real_batches(1))
    gan = models.make_gan()
    gan.training_step = lambda batch: gan.optimizer_step("critic")  # type: ignore[method-assign]
    with pytest.raises(
        ConfigError,
        match=r"optimizer_step\('critic'\): no optimizer of that name; the model's: 'generator', "
        r"'discriminator'",
    ):
        train(gan, real_batches(1))
    gan.training_step = lambda batch: gan.optimizer_step()  # type: ignore[method-assign]
    with pytest.raises(
        ConfigError, match=r"optimizer_step\(\): name the optimizer \('generator', 'discriminator'\)"
    ):
        train(gan, real_batches(1))


def test_manual_optimization_without_a_validation_step_cannot_evaluate() -> None:
    generator, discriminator = models.gan_modules()
    model = TorchModel(
        {"generator": generator, "discriminator": discriminator},
        models.gan_optimizers(generator, discriminator),
        training_step=models.gan_step,
        automatic_optimization=False,
        device="cpu",
    )
    with pytest.raises(ConfigError, match=r"has no validation_step to evaluate the stream\(s\) 'valid'"):
        Loop(model, {"train": real_batches(1), "valid": real_batches(1)}, plugins={})


def test_a_schedule_naming_no_optimizer_of_the_model_is_one_error_before_training() -> None:
    from epochal_schedule import LRScheduler

    model = models.make_gan()
    with pytest.raises(
        ConfigError,
        match=r"optimizer = 'generatr' is not an optimizer of the model \(did you mean 'generator'\?\)",
    ):
        train(
            model,
            real_batches(1),
            plugins={"lr_scheduler": LRScheduler("StepLR", step_size=1, optimizer="generatr")},
        )
    assert model.optimizer_steps == 0


def test_manual_optimization_set_in_a_subclass_init_is_checked_when_the_loop_takes_the_model() -> None:
    """Lightning sets ``self.automatic_optimization = False`` after its base's ``__init__``: the
    loop checks the model again when it attaches it."""

    class Late(TorchModel):
        def __init__(self) -> None:
            generator, discriminator = models.gan_modules()
            super().__init__(
                {"generator": generator, "discriminator": discriminator},
                models.gan_optimizers(generator, discriminator),
                device="cpu",
                accumulate_grad_batches=2,
            )
            self.automatic_optimization = False

        def training_step(self, batch: Any) -> Any:
            return models.gan_step(self, batch)

    with pytest.raises(ConfigError, match=r"accumulate_grad_batches=2 with automatic_optimization=False"):
        Loop(Late(), {"train": real_batches(1)}, plugins={})


def test_two_schedules_of_two_classes_are_two_tables_of_a_run_config(tmp_path: Path) -> None:
    """The second schedule names the plugin's class as its factory; each schedules its optimizer."""
    from epochal.config import load_config
    from epochal.runner import build_loop

    config = tmp_path / "gan.toml"
    config.write_text(
        """
[loop]
max_epochs = 2
[model]
factory = "own_step_models:make_gan"
lr = 1.0
[data]
factory = "own_step_models:make_gan_data"
n_train = 16
n_valid = 8
[plugins]
autoload = false
order = ["lr_scheduler", "lr_discriminator"]
[plugins.lr_scheduler]
name = "StepLR"
step_size = 1
gamma = 0.5
optimizer = "generator"
[plugins.lr_discriminator]
factory = "epochal_schedule:LRScheduler"
name = "ExponentialLR"
gamma = 0.1
optimizer = "discriminator"
""",
        encoding="utf-8",
    )
    loop = build_loop(load_config(config))
    loop.run()
    optimizers = loop.model.optimizers
    assert optimizers["generator"].param_groups[0]["lr"] == pytest.approx(0.25)
    assert optimizers["discriminator"].param_groups[0]["lr"] == pytest.approx(0.01)
    assert [v for _, v in loop.log.history("lr.generator")] == pytest.approx([1.0, 0.5])
    assert [v for _, v in loop.log.history("lr.discriminator")] == pytest.approx([1.0, 0.1])


def test_16_mixed_with_two_optimizers_under_automatic_optimization_follows_torchs_recipe() -> None:
    """One scaled backward, each optimizer unscaled and stepped through the scaler, one update."""
    model, hand, hand_optimizers, batches = encoder_and_head(precision="16-mixed", gradient_clip_val=0.5)
    train(model, batches)
    scaler = torch.amp.GradScaler("cpu")
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(hand[1](hand[0](x)), y)
        scaler.scale(loss).backward()
        for optimizer in hand_optimizers.values():
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 0.5)
            scaler.step(optimizer)
        scaler.update()
        for optimizer in hand_optimizers.values():
            optimizer.zero_grad()
    same(model.modules["encoder"], hand[0])
    same(model.modules["head"], hand[1])


def test_an_optimizer_stepped_twice_in_a_batch_under_16_mixed_updates_the_scale_between() -> None:
    """torch's scaler unscales an optimizer once per update: a critic stepped twice in one batch
    (before and after the generator) gets an update between its steps, and the batch still
    reports both optimizers stepped."""

    def step(model: TorchModel, batch: Any) -> dict[str, Any]:
        d, g = model.modules["discriminator"], model.modules["generator"]

        def critic() -> None:
            d.zero_grad()
            model.backward(torch.nn.functional.binary_cross_entropy(d(batch), torch.ones(len(batch))))
            model.optimizer_step("discriminator")

        critic()
        g.zero_grad()
        fake = g(torch.randn(len(batch), models.NZ))
        model.backward(torch.nn.functional.binary_cross_entropy(d(fake), torch.ones(len(batch))))
        model.optimizer_step("generator")
        critic()  # the critic again, after the generator
        return {}

    generator, discriminator = models.gan_modules()
    model = TorchModel(
        {"generator": generator, "discriminator": discriminator},
        models.gan_optimizers(generator, discriminator),
        training_step=step,
        automatic_optimization=False,
        precision="16-mixed",
        device="cpu",
    )
    train(model, real_batches(2))
    assert model.stepped_optimizers == {"generator", "discriminator"} and model.optimizer_steps == 2
