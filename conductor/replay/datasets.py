"""Names of the shared replay tables and where they live: light enough for the
command line to build its options without loading any table library."""

from __future__ import annotations

import os
from pathlib import Path

# The shared tables' stems -> the task their rows are graded as when the table names none.
DATASETS = {"gsm8k": "math", "mmlu_pro": "choice"}
REPLAY_ENV = "CONDUCTOR_REPLAY_DIR"
TRAIN_FRACTION = 0.5
SPLITS = ("all", "train", "test")


# Where a replay pool's workers are served unless --api-base says otherwise (`conductor replay serve`).
DEFAULT_URL = "${CONDUCTOR_REPLAY_URL:-http://127.0.0.1:8912/v1}"

# How --replay-dir's help names the default (`default_replay_dir`), in every command that has it.
DEFAULT_DIR_HELP = (f"${REPLAY_ENV}, else shared/replay in the folder that holds the repository (../shared/replay "
                    f"from the repository, whatever the working directory)")


def default_replay_dir() -> Path:
    """$CONDUCTOR_REPLAY_DIR, else the `shared/replay` folder beside the repository."""
    env = os.environ.get(REPLAY_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "shared" / "replay"
