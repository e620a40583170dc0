"""A disk that fills mid-run (issue 12): 1,600 plans (1,458 distinct requests) against the
simulated pool, with the data folder on a 24 MB tmpfs that a filler fills once 400
requests were sent. Prints how the run ended and, after freeing space, whether the rerun
completed and how many requests the sim received more than once (must be 0).

Needs root (mount -t tmpfs). Usage: python bench/disk_full.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
from conductor.sim import start_sim  # noqa: E402

SAMPLE = REPO / "data" / "queries" / "sample.parquet"


def main() -> int:
    # No options: the parser is for --help, and to refuse arguments rather than ignore them.
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if os.geteuid() != 0:
        print("needs root to mount a small tmpfs")
        return 1
    tmp = Path(tempfile.mkdtemp())
    mnt = tmp / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], check=True)
    try:
        return _run(tmp, mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _run(tmp: Path, mnt: Path) -> int:
    sim_spec = {"skill": 0.9, "latency_ms": {"mean": 20, "sd": 5}}
    server = tmp / "server.yaml"
    server.write_text(yaml.safe_dump({"workers": [{"id": n, "model": f"openai/{n}", "simulate": sim_spec}
                                                  for n in ("fast", "weak")]}))
    with start_sim(server, [SAMPLE]) as sim:
        pool = tmp / "pool.yaml"
        pool.write_text(yaml.safe_dump({
            "providers": {"sim": {"max_concurrency": 64, "timeout_s": 10}},
            "workers": [{"id": n, "model": f"openai/{n}", "provider": "sim", "api_base": sim.url,
                         "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0},
                         "params": {"temperature": 0, "max_tokens": 256}} for n in ("fast", "weak")]}))
        cmd = [sys.executable, "-m", "conductor", "run", str(SAMPLE), "--pool", str(pool),
               "--data-dir", str(mnt / "data"), "--samples", "4", "--no-cache", "--quiet"]
        env = {**os.environ, "CONDUCTOR_RESERVE_BYTES": str(2 << 20), "PYTHONPATH": str(REPO)}
        filler = mnt / "filler"

        def fill() -> None:
            while sim.log()["total"] < 400:
                time.sleep(0.05)
            with open(filler, "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * 65536)
                        f.flush()
                except OSError:
                    pass

        t = threading.Thread(target=fill, daemon=True)
        t.start()
        t0 = time.monotonic()
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        t.join()
        print(f"run 1: exit {r.returncode} after {time.monotonic() - t0:.1f} s, {sim.log()['total']} requests sent")
        print("  " + r.stderr.strip()[-400:])
        filler.unlink()
        t0 = time.monotonic()
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        log = sim.log()
        twice = sum(1 for v in log["by_body"].values() if v > 1)
        print(f"run 2: exit {r.returncode} after {time.monotonic() - t0:.1f} s; {log['total']} requests in all, "
              f"{len(log['by_body'])} distinct, {twice} sent more than once")
        print("  " + "\n  ".join(line for line in r.stdout.splitlines() if line.startswith("plan statuses")))
        return 0 if r.returncode == 0 and twice == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
