"""Start-up time of the command line: wall seconds of `conductor --help` and
`conductor sql "select 1"` (against a data folder with an empty runs/ folder, so
the catalog is created and its views refreshed), each the median of --repeat
launches, and which heavy libraries `--help` imported (none is the target).

Target: under 1.5 s each. Usage: python bench/startup.py [--repeat 5] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from conductor import argtypes  # noqa: E402

HEAVY = ("litellm", "dagster", "vllm", "polars", "torch")
TARGET_S = 1.5


def launch(args: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "conductor", *args], cwd=REPO, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def heavy_imports(env: dict[str, str]) -> list[str]:
    """Top-level packages among HEAVY that `conductor --help` imports."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "conductor", "--help"], cwd=REPO, env=env,
                         capture_output=True, text=True, check=True).stderr
    names = {line.rsplit("|", 1)[-1].strip() for line in out.splitlines() if line.startswith("import time:")}
    return sorted(n for n in names if n.split(".")[0] in HEAVY)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=argtypes.int_in(1, 1000), default=5)
    ap.add_argument("--data-dir", type=argtypes.path, default=None,
                    help="data folder for the sql launch (default: a new one)")
    args = ap.parse_args()
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data_dir or Path(tmp)
        (data / "runs").mkdir(parents=True, exist_ok=True)
        runs = {"conductor --help": ["--help"],
                'conductor sql "select 1"': ["sql", "select 1", "--data-dir", str(data)]}
        missed = 0
        for name, argv in runs.items():
            times = [launch(argv, env) for _ in range(args.repeat)]
            med = statistics.median(times)
            missed += med >= TARGET_S
            print(f"{name:28s} median {med:.2f} s over {args.repeat} (min {min(times):.2f}, max {max(times):.2f}); "
                  f"target < {TARGET_S} s: {'met' if med < TARGET_S else 'MISSED'}")
    heavy = heavy_imports(env)
    print(f"heavy imports at --help: {', '.join(heavy) if heavy else 'none'}")
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    return 1 if missed or heavy else 0


if __name__ == "__main__":
    sys.exit(main())
