"""Signed sharded checkpoints on several processes (issue 44, item 2): every rank signs its own
DCP files, so the ranks must hold one key; a run where they do not is refused before the first
batch, on every rank alike, naming the ranks (the ranks compare a MAC of a constant, not keys)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from epochal_checkpoint.sharded import check_keys
from epochal_checkpoint.storage import KEY_ENV

from epochal.errors import ConfigError


def world(*others: str | None) -> Any:
    """Rank 0 (this process) and ranks 1.. holding the keys *others* (None: none)."""
    import hashlib
    import hmac

    def tag(key: str | None) -> str | None:
        if key is None:
            return None
        return hmac.new(key.encode(), b"epochal-checkpoint key check", hashlib.sha256).hexdigest()

    def gather(mine: Any) -> list[Any]:
        return [mine, *map(tag, others)]

    return SimpleNamespace(distributed=True, all_gather_object=gather)


@pytest.mark.parametrize(
    ("mine", "others", "said"),
    [
        ("k", ["k", "k"], None),
        (None, [None], None),
        ("k", [None, "k"], "rank(s) 1 have none"),
        ("k", ["k", "other"], "rank(s) 2 hold another than rank 0's"),
        (None, ["k"], "rank(s) 0 have none"),
    ],
)
def test_ranks_must_hold_the_same_key(
    monkeypatch: pytest.MonkeyPatch, mine: str | None, others: list[str | None], said: str | None
) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    if mine is not None:
        monkeypatch.setenv(KEY_ENV, mine)
    if said is None:
        check_keys(world(*others), "[plugins.checkpoint]")
        return
    with pytest.raises(ConfigError) as raised:
        check_keys(world(*others), "[plugins.checkpoint]")
    message = str(raised.value)
    assert message.startswith('[plugins.checkpoint] format = "sharded" with EPOCHAL_CHECKPOINT_KEY')
    assert said in message and "set the same key on every rank" in message
    assert "other" not in message.replace("another", "") and "'k'" not in message  # no key shown
