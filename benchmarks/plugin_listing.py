"""How long ``verl-core plugins`` takes, next to a bare Python start (goal: under 0.3 s).

Usage: ``python benchmarks/plugin_listing.py [--runs N]``. Prints the median wall time of each
command over N runs, and their ratio. Listing imports no torch or backend, so it should cost little
more than the interpreter start plus scanning installed distributions for entry points.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time


def median_wall_time(command: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()

    script = shutil.which("verl-core")
    listing = [script, "plugins"] if script else [sys.executable, "-m", "verl_core", "plugins"]
    baseline = median_wall_time([sys.executable, "-c", "pass"], args.runs)
    plugins = median_wall_time(listing, args.runs)
    print(f"median of {args.runs} runs")
    print(f"{'python -c pass':<24}{baseline:8.3f} s")
    print(
        f"{' '.join(['verl-core', *listing[-1:]]):<24}{plugins:8.3f} s   ({plugins / baseline:.1f}x python -c pass)"
    )
    print(f"goal: verl-core plugins under 0.3 s: {'met' if plugins < 0.3 else 'NOT met'}")


if __name__ == "__main__":
    main()
