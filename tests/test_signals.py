"""Signals on a real `epochal run` subprocess: SIGINT finishes the epoch, twice or SIGTERM the batch."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epochal.testing import unwrapped

BATCHES_PER_EPOCH = 10


@pytest.fixture
def slow_run(throwaway_site, tmp_path, write_config):
    config = write_config(
        ["tw_alpha"],
        extra="[plugins.tw_alpha]\nsleep = 0.05\n",
    )
    text = config.read_text().replace("max_epochs = 2", "max_epochs = 50").replace("n = 16", "n = 40")
    config.write_text(text)

    def start(max_epochs: int = 50):
        import os

        config.write_text(re.sub(r"max_epochs = \d+", f"max_epochs = {max_epochs}", config.read_text()))

        env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
        env.update(PYTHONPATH=str(throwaway_site), EPOCHAL_TW_OUT=str(tmp_path / "events.jsonl"))
        return subprocess.Popen(
            [sys.executable, "-m", "epochal", "run", str(config)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    return start


def wait_for_batches(events, n, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(e["hook"] == "after_batch" for e in events()) >= n:
            return
        time.sleep(0.01)
    raise AssertionError(f"the run did not reach {n} batches")


def finish(process):
    out, err = process.communicate(timeout=60)
    return process.returncode, out, err


def tail_hooks(events):
    return [e["hook"] for e in events() if e["hook"] in ("after_epoch", "on_interrupt", "after_training")]


def test_first_sigint_finishes_the_epoch(slow_run, events):
    process = slow_run()
    wait_for_batches(events, 3)
    process.send_signal(signal.SIGINT)
    code, out, err = finish(process)
    assert code == 128 + signal.SIGINT, err
    batches = [e for e in events() if e["hook"] == "after_batch"]
    assert len(batches) % BATCHES_PER_EPOCH == 0  # the epoch ran to its end
    assert tail_hooks(events)[-3:] == ["after_epoch", "on_interrupt", "after_training"]
    interrupt = next(e for e in events() if e["hook"] == "on_interrupt")
    assert interrupt["signum"] == signal.SIGINT
    assert events()[-1]["status"] == "interrupted"
    assert "finishing the current epoch" in err
    assert "interrupted" in out


def test_first_sigint_in_the_last_epoch_finishes_the_run(slow_run, events, tmp_path):
    process = slow_run(max_epochs=1)
    wait_for_batches(events, 3)
    process.send_signal(signal.SIGINT)
    code, out, err = finish(process)
    assert code == 0, err  # the epoch it finished was the last: nothing is left to resume
    assert len([e for e in events() if e["hook"] == "after_batch"]) == BATCHES_PER_EPOCH
    assert tail_hooks(events)[-2:] == ["after_epoch", "after_training"]  # no on_interrupt
    assert events()[-1]["status"] == "finished"
    assert "max_epochs=1 reached (SIGINT received as training ended)" in unwrapped(out)


def test_second_sigint_finishes_the_batch(slow_run, events):
    process = slow_run()
    wait_for_batches(events, 3)
    process.send_signal(signal.SIGINT)
    time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    code, _, err = finish(process)
    assert code == 128 + signal.SIGINT, err
    batches = [e for e in events() if e["hook"] == "after_batch"]
    assert len(batches) < BATCHES_PER_EPOCH  # stopped inside the first epoch
    assert tail_hooks(events) == ["on_interrupt", "after_training"]
    assert "stopping after the current batch" in err


def test_sigterm_finishes_the_batch(slow_run, events):
    process = slow_run()
    wait_for_batches(events, 3)
    process.send_signal(signal.SIGTERM)
    code, out, err = finish(process)
    assert code == 128 + signal.SIGTERM, err
    batches = [e for e in events() if e["hook"] == "after_batch"]
    assert 3 <= len(batches) < BATCHES_PER_EPOCH
    assert tail_hooks(events) == ["on_interrupt", "after_training"]
    interrupt = next(e for e in events() if e["hook"] == "on_interrupt")
    assert interrupt["signum"] == signal.SIGTERM
    assert "SIGTERM received" in out


# -- the wind-down: after training, during the summary and the process's exit -------------------


@pytest.fixture
def lingering_run(throwaway_site, tmp_path, write_config):
    """Start a short run whose process lingers in *phase* (see linger.py); return the process
    once it lingers."""
    shutil.copy(Path(__file__).parent / "linger.py", tmp_path / "linger.py")

    def start(phase, extra=""):
        table = f'[plugins.linger]\nfactory = "linger:Linger"\nphase = "{phase}"\n{extra}'
        config = write_config([], extra=table)
        import os

        env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env.update(PYTHONPATH=os.pathsep.join([str(throwaway_site), str(tmp_path), *inherited]))
        process = subprocess.Popen(
            [sys.executable, "-m", "epochal", "run", str(config)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while not (tmp_path / "lingering-0").exists():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the run did not reach its wind-down"
            time.sleep(0.01)
        return process

    return start


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["summary", "exit"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_after_training_leaves_a_finished_run_finished(lingering_run, phase, signum):
    """Issue 31: a signal during the summary or the process's exit killed it with no message."""
    process = lingering_run(phase)
    process.send_signal(signum)
    code, out, err = finish(process)
    assert code == 0, (code, err)
    assert f"{signal.Signals(signum).name} received after training ended" in err
    assert "finished after 2 epoch(s)" in out
    assert "Traceback" not in err


@pytest.mark.slow
def test_a_third_sigint_during_after_training_says_training_had_ended(lingering_run):
    """Issue 44, item 8: it said "nothing was saved at this point" with the run's training done."""
    process = lingering_run("after_training")
    for _ in range(3):
        process.send_signal(signal.SIGINT)
        time.sleep(0.05)
    code, _, err = finish(process)
    assert code == 128 + signal.SIGINT, err
    assert "stopped at once by a third SIGINT" in err and "nothing was saved" not in err
    assert "after training ended (max_epochs=2 reached), during its after_training hooks" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_a_signal_after_an_interrupted_run_keeps_the_interrupts_status(lingering_run):
    process = lingering_run("exit", extra="sigterm_at = 2\n")
    process.send_signal(signal.SIGINT)
    code, out, err = finish(process)
    assert code == 128 + signal.SIGTERM, err
    assert "interrupted after" in out
    assert "SIGINT received after training ended" in err


LATE = '''
import time
from pathlib import Path

from epochal import hookimpl


class Teardown:
    """Lingers while the interpreter tears its modules down, after every exit function."""

    def __del__(self):
        Path("lingering-teardown").write_text("now")
        time.sleep(3)


class Late:
    @hookimpl
    def after_training(self, loop):
        global kept
        kept = Teardown()  # a module global: deleted when the modules are torn down
'''


@pytest.mark.slow
def test_a_signal_while_the_interpreter_tears_down_leaves_a_finished_run_finished(
    throwaway_site, tmp_path, write_config
):
    """Found by an outside-user pass: after the exit functions the interpreter reset the handlers,
    and a SIGTERM in the ~0.5 s of teardown that follows killed a finished run (143)."""
    import os

    (tmp_path / "late.py").write_text(LATE)
    config = write_config([], extra='[plugins.late]\nfactory = "late:Late"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPOCHAL_")}
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(PYTHONPATH=os.pathsep.join([str(throwaway_site), str(tmp_path), *inherited]))
    process = subprocess.Popen(
        [sys.executable, "-m", "epochal", "run", str(config)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not (tmp_path / "lingering-teardown").exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the run did not reach its teardown"
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    code, out, err = finish(process)
    assert code == 0, (code, err)
    assert "finished after 2 epoch(s)" in out
