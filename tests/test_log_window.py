"""The training log keeps a window of rows in memory and reads evicted rows back lazily."""

from __future__ import annotations

import numpy as np
import pytest

from epochal.log import TrainingLog


def fill(window: int | None, steps: int = 200) -> tuple[TrainingLog, list[int]]:
    clock = [0]
    log = TrainingLog(lambda: clock[0], window=window)
    for i in range(steps):
        clock[0] = i
        row = log.current_row
        row["loss"] = 1.0 / (i + 1)
        if i % 10 == 0:
            row["epochs_done"] = i // 10
        if i % 7 == 0:
            row["acc"] = np.float64(i / 100)  # a numpy scalar: read back as a Python float
        if i == 33:
            row["hist"] = [1, 2]  # a container: pinned in memory
    return log, clock


def test_the_resident_rows_stay_within_twice_the_window_and_every_reader_sees_every_row() -> None:
    windowed, _ = fill(8)
    reference, _ = fill(None)
    assert len(windowed.row_map) <= 2 * 8 + 1  # the pinned row with a list
    assert 33 in windowed.row_map and 5 not in windowed.row_map
    assert len(windowed) == len(reference) == 200
    assert 5 in windowed and 500 not in windowed
    assert windowed.state_dict() == reference.state_dict()
    assert windowed.history("epochs_done") == reference.history("epochs_done")
    assert windowed.history("acc") == [(i, v.item()) for i, v in reference.history("acc")]
    assert windowed.last("acc") == reference.last("acc") and windowed.last("nothing", 7) == 7
    assert windowed.peek([3, 150, 999]) == {3: reference[3], 150: reference[150]}


def test_a_row_read_back_is_live_again_and_its_changes_are_kept() -> None:
    log, clock = fill(4, 50)
    assert 2 not in log.row_map
    mark = log.evictions
    log[2]["late"] = "x"
    del log[3]["loss"]
    assert 2 in log.row_map and log[2]["late"] == "x"
    for i in range(50, 80):  # the log advances: the rows read back are evicted again
        clock[0] = i
        log.current_row["loss"] = 0.0
    assert 2 not in log.row_map
    changed = log.evicted_since(mark)
    assert changed[2]["late"] == "x" and "loss" not in changed[3]
    assert dict(log.rows())[2]["late"] == "x" and len(log) == 80
    assert log.last("late") == "x"


def test_last_skips_keys_removed_from_a_row_read_back() -> None:
    log, clock = fill(4, 50)
    log[0]["only"] = 1
    log[9]["only"] = 2
    for i in range(50, 80):
        clock[0] = i
        log.current_row["x"] = 1.0
    assert log.last("only") == 2
    del log[9]["only"]
    assert log.last("only") == 1


def test_loading_a_state_evicts_beyond_the_window() -> None:
    reference, _ = fill(None)
    log = TrainingLog(window=8)
    log.load_state_dict(reference.state_dict())
    assert len(log.row_map) <= 2 * 8 + 1 and log.load_count == 1
    assert log.state_dict() == reference.state_dict()


@pytest.mark.parametrize("window", [0, None])
def test_no_window_keeps_every_row(window: int | None) -> None:
    log, _ = fill(window, 50)
    assert len(log.row_map) == 50 and log.evictions == 0


@pytest.mark.parametrize("seed", range(12))
def test_random_reads_writes_and_read_backs_answer_as_an_unwindowed_log(seed: int) -> None:
    """Rows spilled in chunks, read back, changed, spilled again (one by one) and created late
    (older than rows spilled already): every reader answers as a log that keeps every row, and
    the rows that changed since a mark are all in ``row_map`` or ``evicted_since(mark)``."""
    rng = np.random.default_rng(seed)
    clock = [0]
    windowed = TrainingLog(lambda: clock[0], window=int(rng.integers(1, 6)))
    reference = TrainingLog(lambda: clock[0], window=0)
    mark, snapshot = windowed.evictions, reference.state_dict()["rows"]
    for step in range(400):
        action = rng.random()
        if action < 0.55:  # the log advances with a record or two
            clock[0] += 1
            for log in (windowed, reference):
                log.current_row["loss"] = float(step)
                if step % 3 == 0:
                    log.current_row[f"k{step % 4}"] = step
        elif action < 0.75 and clock[0]:  # an old row read back and changed (or created late)
            i = int(rng.integers(0, clock[0] + 1))
            for log in (windowed, reference):
                log[i]["late"] = f"{step}"
                if step % 5 == 0:
                    log[i].pop("loss", None)
        elif action < 0.85:  # a save: what changed since the previous one
            changed = dict(windowed.row_map)
            changed.update(windowed.evicted_since(mark))
            now = reference.state_dict()["rows"]
            for key, row in now.items():
                if snapshot.get(key) != row:
                    assert changed.get(int(key)) == row, (step, key)
            mark, snapshot = windowed.evictions, now
        else:  # readers that do not make rows resident
            some = [int(i) for i in rng.integers(0, clock[0] + 3, size=5)]
            assert windowed.peek(some) == reference.peek(some)
            lo = int(rng.integers(-2, clock[0] + 2))
            for span in (range(lo, lo + 3), range(lo, lo + 200), range(0, clock[0] + 5)):
                assert windowed.peek(span) == reference.peek(span), span
            assert [i in windowed for i in some] == [i in reference for i in some]
            for key in ("loss", "late", "k0", "k3", "none"):
                assert windowed.last(key) == reference.last(key)
    assert len(windowed) == len(reference)
    assert list(windowed.rows()) == list(reference.rows())
    assert windowed.history("late") == reference.history("late")
    assert windowed.state_dict() == reference.state_dict()
    assert len(windowed.row_map) < len(reference.row_map)
