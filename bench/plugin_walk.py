"""How often a run configuration's data returns to a module it left, from ``runner.build_loop``.

Traces ``epochal.runner.build_loop`` on a small configuration whose plugins are the standard ones
(those installed), recording the module of every epochal function at its first call, in call
order (a function called again is not counted again: a loop over plugins is one visit). Each run
of calls in one module is a *stay*; a stay in a module already left is a *return*. Few returns
mean that what a plugin declares is read in one place and handed on, not fetched again by each
module that needs it (issue 45: at most 10).

    python bench/plugin_walk.py [--show]
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path
from typing import Any

import epochal

ROOT = Path(epochal.__file__).resolve().parent

CONFIG = {
    "loop": {"max_epochs": 1, "seed": 0},
    "model": {"factory": "epochal.examples.tiny:TinyModel"},
    "data": {"factory": "epochal.examples.tiny:tiny_data"},
    "plugins": {"order": ["monitor", "early_stopping", "checkpoint"], "early_stopping": {"patience": 2}},
}


def walk(config: dict[str, Any]) -> list[str]:
    """The modules (paths relative to the package) of epochal's functions at their first call
    while ``build_loop(config)`` runs."""
    from epochal.runner import build_loop

    seen: set[Any] = set()
    order: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code in seen:
            return
        seen.add(code)
        path = Path(code.co_filename)
        if path.is_relative_to(ROOT):
            order.append(str(path.relative_to(ROOT)))

    with tempfile.TemporaryDirectory() as tmp:
        config = {**config, "loop": {**config["loop"], "run_dir": tmp}}
        build_loop(config)  # once untraced: imports and caches are not the walk
        seen.clear()
        sys.setprofile(profile)
        try:
            build_loop(config)
        finally:
            sys.setprofile(None)
    return order


def stays(modules: list[str]) -> list[str]:
    """*modules* with each run of one module counted once."""
    return [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--show", action="store_true", help="print the stays in order")
    args = parser.parse_args()
    path = stays(walk(CONFIG))
    returns = [m for i, m in enumerate(path) if m in path[:i]]
    if args.show:
        print(" -> ".join(path))
    visits = collections.Counter(path)
    print(f"{len(path)} stays, {len(returns)} returns")
    for module, count in visits.most_common():
        if count > 1:
            print(f"  {module}: {count} visits")


if __name__ == "__main__":
    main()
