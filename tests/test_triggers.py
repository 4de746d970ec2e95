"""``epochal.triggers``: the conditions a plugin tests, and the trigger keys the core gates hooks with."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from epochal.examples.tiny import TinyModel, tiny_data
from epochal.testing import run_loop
from epochal.triggers import LogCondition, Triggers, every_n_batches, every_n_epochs, parse_triggers


def at(iteration: int = 0, epoch: int = 0) -> SimpleNamespace:
    return SimpleNamespace(iteration=iteration, epoch=epoch)


def test_every_n_counts_completed_batches_and_epochs_and_zero_is_never():
    due = every_n_batches(3)
    assert [i for i in range(1, 10) if due(at(iteration=i))] == [3, 6, 9]
    assert not any(every_n_batches(0)(at(iteration=i)) for i in range(10))
    assert [e for e in range(1, 7) if every_n_epochs(2)(at(epoch=e))] == [2, 4, 6]


def test_a_negative_count_is_refused():
    with pytest.raises(ValueError):
        every_n_batches(-1)


def test_trigger_keys_gate_the_hooks_of_a_plugins_table():
    triggers = parse_triggers({"every_n_epochs": 2, "before_first_epoch": False}, "[plugins.x]")
    assert isinstance(triggers, Triggers)
    gate = triggers.gate("after_epoch")
    assert callable(gate) and gate(at(epoch=2)) and not gate(at(epoch=3))
    assert triggers.gate("before_training") is False
    assert triggers.gate("on_error") is True  # not a batch or an epoch hook
    assert parse_triggers({"patience": 3}, "[plugins.x]") is None  # no trigger key


def test_a_bad_trigger_value_names_its_table_and_key():
    with pytest.raises(ValueError, match=r"\[plugins.x\] when: "):
        parse_triggers({"when": "valid.loss <"}, "[plugins.x]")


def test_a_log_condition_reads_the_training_log_of_a_run():
    result = run_loop({}, model=TinyModel(), data=tiny_data(), max_epochs=3)
    assert LogCondition("epochs_done >= 3")(result.loop) is True
    assert LogCondition("epochs_done >= 4")(result.loop) is False
    assert LogCondition("valid.loss < 1e9 and epochs_done == 3")(result.loop) is True
    assert set(LogCondition("valid.loss < train.loss").names) == {"valid.loss", "train.loss"}
