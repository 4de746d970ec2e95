"""Small pieces with their own rules: the call-order sort, triggers, the training log, --set."""

from __future__ import annotations

import pytest

from epochal import ConfigError, OrderError
from epochal.config import apply_override
from epochal.log import TrainingLog
from epochal.ordering import call_order
from epochal.triggers import after_n_batches, after_n_epochs, every_n_batches, every_n_epochs, every_n_seconds


def test_order_keeps_the_preferred_order_without_constraints():
    assert call_order(["c", "a", "b"], ["c"], {}, {}) == ["c", "a", "b"]


def test_run_before_moves_a_plugin_just_before_its_target():
    assert call_order(["a", "b", "c", "d"], [], {"d": ["b"]}, {}) == ["a", "d", "b", "c"]


def test_run_after_moves_the_target_up_not_the_whole_list():
    assert call_order(["x", "a", "b", "c"], [], {}, {"x": ["c"]}) == ["c", "x", "a", "b"]


def test_constraints_on_absent_plugins_are_ignored():
    assert call_order(["a", "b"], [], {"a": ["zzz"]}, {"b": ["yyy"]}) == ["a", "b"]


def test_cycle_names_every_member_and_every_reason():
    with pytest.raises(OrderError) as info:
        call_order(["a", "b", "c"], [], {"a": ["b"], "b": ["c"], "c": ["a"]}, {})
    message = str(info.value)
    for text in ("'a' declares run_before 'b'", "'b' declares run_before 'c'", "'c' declares run_before 'a'"):
        assert text in message


class Counters:
    def __init__(self, epoch=0, iteration=0):
        self.epoch, self.iteration = epoch, iteration


def test_triggers():
    assert [i for i in range(1, 10) if every_n_batches(3)(Counters(iteration=i))] == [3, 6, 9]
    assert [e for e in range(0, 7) if every_n_epochs(2)(Counters(epoch=e))] == [2, 4, 6]
    assert not every_n_batches(0)(Counters(iteration=3))
    assert [i for i in range(1, 6) if after_n_batches(3)(Counters(iteration=i))] == [3, 4, 5]
    assert after_n_epochs(2)(Counters(epoch=2)) and not after_n_epochs(2)(Counters(epoch=1))
    with pytest.raises(ValueError, match="every_n_batches"):
        every_n_batches(-1)


def test_every_n_seconds_uses_its_clock():
    now = [0.0]
    due = every_n_seconds(10, clock=lambda: now[0])
    assert not due()
    now[0] = 5
    assert not due()
    now[0] = 10
    assert due()
    now[0] = 15
    assert not due()


def test_training_log_rows_and_state():
    iteration = [0]
    log = TrainingLog(lambda: iteration[0])
    log.current_row["a"] = 1
    iteration[0] = 3
    log.current_row["a"] = 2.5
    log.current_row["b"] = "x"
    assert log.last("a") == 2.5 and log.last("missing", 7) == 7
    assert log.history("a") == [(0, 1), (3, 2.5)]
    assert log.previous_row == {}
    copy = TrainingLog()
    copy.load_state_dict(log.state_dict())
    assert list(copy.rows()) == list(log.rows())
    assert copy.status == log.status


def test_set_overrides_parse_toml_values():
    config: dict = {"loop": {}}
    apply_override(config, "loop.max_epochs=3")
    apply_override(config, "plugins.checkpoint.dir=runs/x")
    apply_override(config, "plugins.order=['a', 'b']")
    assert config == {
        "loop": {"max_epochs": 3},
        "plugins": {"checkpoint": {"dir": "runs/x"}, "order": ["a", "b"]},
    }
    with pytest.raises(ConfigError, match=r"section\.key=value"):
        apply_override(config, "loop")
