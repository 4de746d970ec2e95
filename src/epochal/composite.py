"""Composite plugins: several plugins configured, ordered and shipped as one unit."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class CompositePlugin:
    """A plugin made of named child plugins (Blocks' ``CompositeExtension``).

    The composite is ordered as one unit: its children run consecutively, in the order given,
    at the composite's place in the call order. Each child is registered as ``parent/child``,
    so ``--disable parent/child`` leaves out one child, ``[plugins."parent/child"]`` is not
    needed (the composite builds its children), and ``loop.plugins["parent/child"]`` finds it.
    Hook implementations on the composite itself run just before its children's.

    Subclass it and build the children from the composite's own options::

        class Guarded(CompositePlugin):
            def __init__(self, metric: str = "valid.loss", patience: int = 5):
                super().__init__({
                    "stop": EarlyStopping(monitor=metric, patience=patience),
                    "save": Checkpoint(keep_best=1, monitor=metric),
                })

    ``run_before``/``run_after`` declared on the composite or on any child apply to the unit.
    """

    run_before: Sequence[str] = ()
    run_after: Sequence[str] = ()

    def __init__(self, plugins: Mapping[str, object]) -> None:
        for name in plugins:
            if not name or "/" in name:
                raise ValueError(f"invalid child plugin name {name!r}: must be non-empty, no '/'")
        self.plugins: dict[str, object] = dict(plugins)
