"""epochal + TorchModel against a hand-written PyTorch loop (and Lightning), side by side.

What is measured: the wall time of whole training runs (``EPOCHS`` epochs of ``STEPS`` steps on
the same synthetic batches, already on the device), divided by the number of steps; objects
(optimizer, plugins, loop, Trainer) are built before the clock starts, the run call is timed
(``Loop.run()``, ``Trainer.fit()``). The cases:

* ``raw loop``: ``zero_grad / forward / loss / backward / step``, reading the loss on the host
  every 100 steps (what a hand-written loop that logs does).
* ``epochal, no plugins``: ``Loop(TorchModel(...), plugins={})``.
* ``epochal, six plugins``: monitor (epoch means), early_stopping (never triggers), checkpoint
  every epoch, sqlite_log, timing, progress (forced, drawn to /dev/null); and the same with the
  checkpoint's ``async_save`` (the state is copied to host memory, written in the background).
* ``lightning, bare`` and ``lightning + callbacks`` (progress bar, ModelCheckpoint every epoch,
  EarlyStopping, Timer, CSVLogger), where Lightning is installed.

Models: a small MLP (launch-bound: the framework's per-step cost shows) and torchvision's
ResNet-18 on 3x32x32 images (compute-bound), where torchvision is installed. Rounds are
interleaved (every case once per round, the order rotating) and the median is reported, with
each case's ratio to the raw loop and the median of its per-round ratios (with their spread),
and the ratio of the case's fastest run to the raw loop's fastest (interference only adds time).
Where the six plugins' time goes: the ``timing`` plugin (one of the six) times every plugin's
hooks; after the rounds, the medians of its totals for the whole run are printed per step of
the run: the model's step, each plugin's hooks (every save and the end of training each
counted once) and the rest (the plugins' start-up: their ``before_training`` runs in the call
that starts the timing plugin's clocks; the loop's own work, the timing plugin's, the final
wait for the device); the parts add up to the run's wall time, i.e. to the case's ratio to the
raw loop.
Runs with longer epochs (``BENCH_STEPS=3000``) split what a plugin costs per step from what it
costs per epoch.

Run ``python bench/torch_loop.py`` (CUDA when available, else the CPU);
``BENCH_DEVICE``, ``BENCH_EPOCHS``, ``BENCH_STEPS``, ``BENCH_REPEATS``, ``BENCH_MODELS``
(``mlp,resnet18``), ``BENCH_CASES`` (some of ``raw,bare,six,async,pl,pl+cb``; the raw loop always
runs), ``BENCH_JSON`` (a file for the figures) override the defaults. The warm-up runs each case
once for one epoch of at most 100 steps; on a GPU the raw loop first runs for ``BENCH_WARMUP_S``
seconds (default 3), so that the first round does not run at the clocks of an idle GPU.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DEVICE = torch.device(os.environ.get("BENCH_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))
ON_GPU = DEVICE.type == "cuda"
EPOCHS = int(os.environ.get("BENCH_EPOCHS", 3))
STEPS = int(os.environ.get("BENCH_STEPS", 300 if ON_GPU else 200))
REPEATS = int(os.environ.get("BENCH_REPEATS", 3 if ON_GPU else 5))
MODELS = os.environ.get("BENCH_MODELS", "mlp,resnet18" if ON_GPU else "mlp").split(",")
CASES = os.environ.get("BENCH_CASES", "raw,bare,six,async,pl,pl+cb").split(",")
WARMUP_S = float(os.environ.get("BENCH_WARMUP_S", 3 if ON_GPU else 0))


def sync() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def make_mlp() -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    width, batch = (1024, 512) if ON_GPU else (256, 64)
    module = torch.nn.Sequential(
        torch.nn.Linear(128, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )  # fmt: skip
    data = [
        (torch.randn(batch, 128, device=DEVICE), torch.randint(0, 10, (batch,), device=DEVICE))
        for _ in range(16)
    ]
    return module.to(DEVICE), data


def make_resnet18() -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    import torchvision

    torch.manual_seed(0)
    module = torchvision.models.resnet18(num_classes=10)
    data = [
        (torch.randn(256, 3, 32, 32, device=DEVICE), torch.randint(0, 10, (256,), device=DEVICE))
        for _ in range(8)
    ]
    return module.to(DEVICE), data


def batches(data: list[Any], steps: int) -> list[Any]:
    return [data[i % len(data)] for i in range(steps)]


#: a case builds its objects (untimed) for (module, data, workdir, epochs, steps) and returns
#: the run to time.
Case = Callable[[torch.nn.Module, list[Any], Path, int, int], Callable[[], None]]


def raw_loop(
    module: torch.nn.Module, data: list[Any], workdir: Path, epochs: int, steps_: int
) -> Callable[[], None]:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
    steps = batches(data, steps_)

    def run() -> None:
        for _ in range(epochs):
            for i, (x, y) in enumerate(steps):
                optimizer.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(module(x), y)
                loss.backward()
                optimizer.step()
                if i % 100 == 0:
                    loss.item()
        sync()

    return run


def epochal_loop(plugins: str, async_save: bool = False) -> Case:
    def prepare(
        module: torch.nn.Module, data: list[Any], workdir: Path, epochs: int, steps: int
    ) -> Callable[[], None]:
        from epochal import Loop, load_plugins
        from epochal.torch import TorchModel

        optimizer = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
        model = TorchModel(module, optimizer, torch.nn.functional.cross_entropy, device=DEVICE)
        if plugins == "none":
            plugin_set: Any = {}
        else:
            plugin_set = load_plugins(
                order=["monitor", "early_stopping", "checkpoint", "sqlite_log", "timing", "progress"],
                autoload=False,
                options={
                    "early_stopping": {"monitor": "train.loss", "patience": 10**9},
                    "checkpoint": {"dir": str(workdir / "ckpt"), "keep_last": 1, "async_save": async_save},
                    "sqlite_log": {"path": str(workdir / "log.sqlite")},
                    "progress": {"force": True},
                },
            )
        loop = Loop(model, {"train": batches(data, steps)}, plugins=plugin_set, max_epochs=epochs,
                    run_dir=workdir, handle_signals=False)  # fmt: skip

        def run() -> None:
            loop.run()
            sync()

        run.loop = loop  # type: ignore[attr-defined]  # the breakdown reads its timing totals
        return run

    return prepare


def lightning_loop(callbacks: bool) -> Case:
    def prepare(
        module: torch.nn.Module, data: list[Any], workdir: Path, epochs: int, steps: int
    ) -> Callable[[], None]:
        import lightning

        class Wrapped(lightning.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = module

            def training_step(self, batch: Any, index: int) -> torch.Tensor:
                x, y = batch
                loss = torch.nn.functional.cross_entropy(self.net(x), y)
                if callbacks:
                    self.log("train_loss", loss, on_step=False, on_epoch=True)
                return loss

            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

        extra: dict[str, Any] = {"enable_checkpointing": False, "enable_progress_bar": False, "logger": False}
        if callbacks:
            from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, Timer, TQDMProgressBar
            from lightning.pytorch.loggers import CSVLogger

            extra = {
                "callbacks": [
                    TQDMProgressBar(refresh_rate=100),
                    ModelCheckpoint(dirpath=workdir / "ckpt", every_n_epochs=1),
                    EarlyStopping("train_loss", patience=10**9),
                    Timer(),
                ],
                "logger": CSVLogger(workdir),
            }
        trainer = lightning.Trainer(
            max_epochs=epochs, accelerator="gpu" if ON_GPU else "cpu", devices=1, num_sanity_val_steps=0,
            enable_model_summary=False, default_root_dir=workdir, **extra,
        )  # fmt: skip
        from torch.utils.data import DataLoader

        # batch_size=None: the batches as they are (a plain list would read as several loaders)
        loader = DataLoader(batches(data, steps), batch_size=None)
        wrapped = Wrapped()

        def run() -> None:
            trainer.fit(wrapped, train_dataloaders=loader)
            sync()

        return run

    return prepare


def cases() -> dict[str, Case]:
    found: dict[str, Case] = {"raw loop": raw_loop}
    wanted = {
        "bare": ("epochal, no plugins", lambda: epochal_loop("none")),
        "six": ("epochal, six plugins", lambda: epochal_loop("six")),
        "async": ("epochal, six, async ckpt", lambda: epochal_loop("six", async_save=True)),
        "pl": ("lightning, bare", lambda: lightning_loop(False)),
        "pl+cb": ("lightning + callbacks", lambda: lightning_loop(True)),
    }
    for key, (name, make) in wanted.items():
        if key not in CASES or (key.startswith("pl") and os.environ.get("BENCH_LIGHTNING", "1") != "1"):
            continue
        if key.startswith("pl"):
            try:
                import lightning  # noqa: F401
            except ImportError:
                continue
        found[name] = make()
    return found


def breakdown(run: Callable[[], None], wall: float) -> dict[str, float]:
    """Where a run's *wall* seconds went, from the ``timing`` plugin's totals of the whole run
    (``log.status["timing"]``): ``train_step`` (the model's step), ``read_data``, each plugin's
    hooks (``<plugin>.<hook>``, end of training included, every epoch's save counted once) and
    ``rest`` (the plugins' ``before_training``, run in the call that starts the clocks; the
    loop's own work between hooks, the timing plugin's, the final wait for the device). They
    add up to *wall*."""
    summary = run.loop.log.status["timing"]  # type: ignore[attr-defined]
    parts = {"train_step": summary["train_step"]["seconds"], "read_data": summary["read_data"]["seconds"]}
    for key, cell in summary.items():
        if key.startswith("plugin."):
            parts[key.removeprefix("plugin.")] = cell["seconds"]
    parts["rest"] = wall - sum(parts.values())
    return parts


def main() -> None:
    warnings.filterwarnings("ignore")
    from epochal_checkpoint.storage.codec import crc32

    fast = "zlib_ng" in crc32.__module__
    print("CRC-32 of the checkpoints:", "zlib-ng" if fast else "zlib (no zlib-ng: ~5x slower)")
    makers = {"mlp": make_mlp, "resnet18": make_resnet18}
    results: dict[str, dict[str, float]] = {}
    for name in MODELS:
        try:
            module, data = makers[name]()
        except ImportError as error:
            print(f"{name}: skipped ({error})")
            continue
        initial = {k: v.clone() for k, v in module.state_dict().items()}
        times: dict[str, list[float]] = {case: [] for case in cases()}
        profiles: dict[str, list[dict[str, float]]] = {}
        with tempfile.TemporaryDirectory() as tmp:  # the GPU's clocks up from idle
            started = time.perf_counter()
            while time.perf_counter() - started < WARMUP_S:
                raw_loop(module, data, Path(tmp), 1, min(STEPS, 100))()
        for prepare in cases().values():  # warm-up: kernels, cuDNN autotuning, imports
            module.load_state_dict(initial)
            module.to(DEVICE)
            with tempfile.TemporaryDirectory() as tmp, _quiet():
                prepare(module, data, Path(tmp), 1, min(STEPS, 100))()
        for round_ in range(REPEATS):
            ordered = list(cases().items())
            shift = round_ % len(ordered)  # the order rotates: no case always runs first
            for case, prepare in ordered[shift:] + ordered[:shift]:
                module.load_state_dict(initial)
                module.to(DEVICE)  # Lightning moves the module back to the CPU when it ends
                with tempfile.TemporaryDirectory() as tmp, _quiet():
                    run = prepare(module, data, Path(tmp), EPOCHS, STEPS)  # objects built before the clock
                    gc.collect()
                    sync()
                    start = time.perf_counter()
                    run()
                    wall = time.perf_counter() - start
                    times[case].append(wall / (EPOCHS * STEPS))
                    if "six" in case:
                        profiles.setdefault(case, []).append(breakdown(run, wall))
        medians = {case: statistics.median(t) for case, t in times.items()}
        results[name] = dict(medians)
        floor = medians["raw loop"]
        print(f"\n{name} on {_device_name()} ({EPOCHS} x {STEPS} steps, median of {REPEATS} rounds)")
        print(
            f"  {'case':24s} {'ms/step':>9s}  {'vs raw':>7s}  per-round ratio: median [min-max]  fastest runs"
        )
        for case, value in medians.items():
            # each round's cases ran back to back: the per-round ratio is steadier than the
            # ratio of medians where the machine's speed drifts between rounds (GPU clocks)
            paired = sorted(t / r for t, r in zip(times[case], times["raw loop"]))
            # the fastest run of each case against the raw loop's fastest: what a case costs where
            # the machine's interference (which only ever adds time) was least
            best = min(times[case]) / min(times["raw loop"])
            print(
                f"  {case:24s} {value * 1e3:9.3f}  {value / floor:6.3f}x  "
                f"{statistics.median(paired):.3f}x [{paired[0]:.3f}-{paired[-1]:.3f}]  {best:.3f}x"
            )
            results[name][f"{case} / raw, per round"] = statistics.median(paired)
            results[name][f"{case} / raw, fastest runs"] = best
        for case, runs in profiles.items():
            results[name][f"{case}: timing"] = _print_profile(case, runs, floor)
    if path := os.environ.get("BENCH_JSON"):
        Path(path).write_text(json.dumps({"device": _device_name(), "results": results}, indent=2))


def _print_profile(case: str, runs: list[dict[str, float]], floor: float) -> dict[str, float]:
    """Print where *case*'s time went (medians over its rounds of :func:`breakdown`), each part
    per step of the run and as a share of the raw loop's step (*floor*), the largest first;
    returns the medians (seconds per run)."""
    keys = {key for run in runs for key in run}
    medians = {key: statistics.median(run.get(key, 0.0) for run in runs) for key in keys}
    steps = EPOCHS * STEPS
    print(f"  where {case!r} spends its time (timing plugin's totals, medians), per step of the run:")
    shown = 0.0
    for key in sorted(keys, key=lambda k: -abs(medians[k])):
        share = medians[key] / steps / floor
        shown += share
        if abs(share) < 0.0005:
            continue
        print(f"    {key:40s} {medians[key] / steps * 1e6:8.1f} µs/step ({share:7.2%} of a raw step;"
              f" {medians[key] * 1e3:8.3f} ms per run)")  # fmt: skip
    print(f"    {'(all parts)':40s} {'':8s}          ({shown:7.2%} of a raw step)")
    return medians


def _device_name() -> str:
    return torch.cuda.get_device_name(DEVICE) if ON_GPU else "CPU"


@contextlib.contextmanager
def _quiet() -> Any:
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        saved = sys.stdout
        try:
            yield
        finally:
            sys.stdout = saved


if __name__ == "__main__":
    main()
