"""A refactoring costs nothing: ``loop_overhead.py`` and ``torch_loop.py`` on two source trees, side by side.

Each round runs both benchmarks once on the *base* tree (a git worktree of ``--base``, made in a
temporary folder) and once on this tree, alternating which goes first, so the load of a shared
machine hits both alike. Reported: for every figure (the epochal loop's time per step with 0, 1,
6 and 20 plugins; epochal + ``TorchModel`` with no plugins and with six), the median over the
rounds on each tree and the median of the per-round ratios this tree / base (< 1: faster).

    python bench/before_after.py --base 95636de [--rounds 5] [--steps 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: the first table of loop_overhead.py: plugins, bare, direct, epochal (ns per step).
ROW = re.compile(r"^\s*(\d+)\s+(\d+)ns\s+(\d+)ns\s+(\d+)ns")


def source_path(tree: Path) -> str:
    folders = [tree / "src", *sorted(tree.glob("plugins/*/src")), *sorted(tree.glob("examples/*/src"))]
    return os.pathsep.join(str(folder) for folder in folders)


def run(tree: Path, script: str, args: list[str], env: dict[str, str]) -> str:
    environment = {**os.environ, **env, "PYTHONPATH": source_path(tree)}
    done = subprocess.run(
        [sys.executable, str(HERE / script), *args],
        env=environment,
        capture_output=True,
        text=True,
        check=True,
        cwd=tree,
    )
    return done.stdout


def loop_figures(tree: Path, steps: int) -> dict[str, float]:
    out = run(tree, "loop_overhead.py", ["--steps", str(steps), "--repeats", "3"], {})
    figures: dict[str, float] = {}
    for line in out.splitlines():
        match = ROW.match(line)
        if match:
            figures[f"loop, {match.group(1)} plugins (ns/step)"] = float(match.group(4))
            figures[f"loop, {match.group(1)} plugins / direct calls"] = float(match.group(4)) / float(
                match.group(3)
            )
    return figures


def torch_figures(tree: Path) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "figures.json"
        env = {"BENCH_JSON": str(path), "BENCH_REPEATS": "3", "BENCH_MODELS": "mlp", "BENCH_DEVICE": "cpu"}
        run(tree, "torch_loop.py", [], env)
        results = json.loads(path.read_text())["results"]["mlp"]
    raw = results["raw loop"]
    return {
        f"TorchModel MLP, {case} / raw loop": value / raw
        for case, value in results.items()
        if case.startswith("epochal")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base", required=True, help="the commit to compare with (e.g. main before a change)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--no-torch", action="store_true", help="leave torch_loop.py out")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), args.base], check=True
        )
        try:
            samples: dict[str, dict[str, list[float]]] = {"base": {}, "this": {}}
            for round_ in range(args.rounds):
                trees = [("base", base), ("this", ROOT)]
                for label, tree in trees if round_ % 2 == 0 else reversed(trees):
                    figures = loop_figures(tree, args.steps)
                    if not args.no_torch:
                        figures.update(torch_figures(tree))
                    for key, value in figures.items():
                        samples[label].setdefault(key, []).append(value)
                print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    print(f"{args.rounds} interleaved rounds; base = {args.base}, this = the working tree")
    print(f"{'figure':48s} {'base':>10s} {'this':>10s} {'this/base':>10s} {'min-max':>12s}")
    for key, before in samples["base"].items():
        after = samples["this"].get(key, [])
        if not after:
            continue
        ratios = [b / a for a, b in zip(before, after, strict=False)]
        print(
            f"{key:48s} {statistics.median(before):10.3f} {statistics.median(after):10.3f} "
            f"{statistics.median(ratios):9.3f}x {min(ratios):5.2f}-{max(ratios):.2f}x"
        )


if __name__ == "__main__":
    main()
