"""The learned policy on disk: one versioned folder per training, per pool.

    <root>/<pool key>/v0001/policy.json   format version, pool identity, action encoding,
                           model.vw       feature settings, lambda, training summary
    <root>/<pool key>/v0002/...           the next training; planning uses the highest

<root> is `data/policy` unless $CONDUCTOR_POLICY_DIR or the planner option
`policy=PATH` says otherwise. The pool key hashes what the actions mean (worker
ids, kinds, models, functions, parameters), not where the workers are served, so
a replay pool keeps its policy when its server moves to another port.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import secrets
import shutil
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson

from conductor import __version__
from conductor.errors import ConductorError
from conductor.policy import metacheck
from conductor.policy.actions import Action, ActionSettings
from conductor.policy.features import FeatureSettings
from conductor.pool import Pool

FORMAT = "conductor-policy"
FORMAT_VERSION = 2  # 2: cascade actions, the shipped choice between learned and fixed
META_FILE = "policy.json"
POLICY_ENV = "CONDUCTOR_POLICY_DIR"
_VERSION_DIR = re.compile(r"^v(\d{4,})\Z")


def default_root() -> Path:
    return Path(os.environ.get(POLICY_ENV) or "data/policy").expanduser()


def pool_key(pool: Pool) -> str:
    ident = [[w.id, w.kind, w.model, w.function, w.params, w.system] for w in pool.workers]
    dataset = (pool.replay or {}).get("dataset")
    return hashlib.sha256(orjson.dumps([ident, dataset], option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def prices(pool: Pool) -> dict[str, list[float] | None]:
    """Per worker, USD per input and output token. Not part of the pool key (that would orphan
    every artifact at a price update); saved beside it so a later change can be said."""
    return {w.id: [w.price.input, w.price.output] if w.price else None for w in pool.workers}


def price_changes(meta: dict[str, Any], pool: Pool) -> list[str]:
    """The workers whose price differs from the one training saw, 'id: old -> new'; none for
    artifacts written before prices were recorded."""
    then, now = meta["pool"].get("prices"), prices(pool)
    if not isinstance(then, dict):
        return []
    return [f"{w}: {usd_pair(old)} -> {usd_pair(now[w])}" for w, old in then.items()
            if w in now and not same_price(old, now[w])]


def same_price(a: list[float] | None, b: list[float] | None) -> bool:
    if a is None or b is None:
        return a is b
    return all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-18) for x, y in zip(a, b))


def usd_pair(p: list[float] | None) -> str:
    return "no price" if p is None else f"${p[0] * 1e6:.6g}/${p[1] * 1e6:.6g}"


def mismatch(folder: Path, meta: dict[str, Any], pool: Pool) -> str | None:
    """Why the artifact cannot plan for `pool` (it was trained for another pool key), or None."""
    key = pool_key(pool)
    if meta["pool"]["key"] == key:
        return None
    return (f"policy {folder} was trained for pool {meta['pool']['key']} ({meta['pool'].get('path')}), "
            f"not this pool ({key}, {pool.path})")


_warned: set[tuple[str, Any]] = set()  # what was said once in this process


def warn_prices(folder: Path, meta: dict[str, Any], pool: Pool) -> list[str]:
    """Say on stderr, once per process and artifact, that the pool's prices moved since training:
    the artifact still plans (prices change often), but its cost trade-offs are the old ones."""
    changes = price_changes(meta, pool)
    seen = (str(Path(folder).resolve()), tuple(changes))
    if changes and seen not in _warned:
        _warned.add(seen)
        print(f"conductor: warning: policy {folder} was trained under other prices than pool {pool.path} "
              f"now has (USD per million input/output tokens): {'; '.join(changes)}. Its lambda "
              f"({meta['lambda']:g}) trade-offs were fitted under the old prices; retrain with "
              f"`conductor policy train` to fit the new ones", file=sys.stderr, flush=True)
    return changes


@dataclass
class Artifact:
    """A loaded policy: metadata, the learner, the actions per task."""

    path: Path
    meta: dict[str, Any]
    learner: Any
    actions: dict[str, list[Action]]  # task ("none" for no task) -> candidate actions
    features: FeatureSettings
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """What each plan's info records as its policy; a price change since training is part of it."""
        stale = " (trained under other prices)" if self.extra.get("price_changes") else ""
        return f"learned {self.meta['pool']['key']}/v{self.meta['version']:04d}{stale}"

    @property
    def lam(self) -> float:
        return float(self.meta["lambda"])

    def close(self) -> None:
        close = getattr(self.learner, "close", None)
        if callable(close):
            close()


def save(root: Path, pool: Pool, learner: Any, *, fixed: Any = None, shipped: str = "learned",
         actions: dict[str, list[Action]], action_settings: ActionSettings,
         features: FeatureSettings, lam: float, training: dict[str, Any], floor: float | None = None,
         budget: float | None = None, fitted_prices: dict[str, list[float] | None] | None = None) -> Path:
    """Write the next version for this pool under `root`; returns its folder. `fixed` (the
    best fixed action per task) is saved beside the learner; `shipped` says which plans.
    `fitted_prices`: the prices the logged costs were paid at (default: the pool's), which
    later price warnings compare against."""
    key = pool_key(pool)
    base = Path(root) / key
    base.mkdir(parents=True, exist_ok=True)
    # os.mkdir, not tempfile.mkdtemp: mkdtemp's mode 0700 would leave the version unreadable to
    # other users of a shared policy root (a Dagster service); this one follows the umask.
    tmp = base / f".tmp-{secrets.token_hex(8)}"
    os.mkdir(tmp)
    try:
        files = learner.save(tmp)
        fixed_meta = None
        if fixed is not None and fixed is not learner:
            fixed_meta = {"kind": fixed.kind, **fixed.describe(), "files": fixed.save(tmp)}
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "created_at": datetime.now(timezone.utc).isoformat(),
            "conductor_version": __version__,
            "pool": {"key": key, "path": str(pool.path) if pool.path else None,
                     "dataset": (pool.replay or {}).get("dataset"),
                     "workers": [w.id for w in pool.workers],
                     "prices": prices(pool) if fitted_prices is None else fitted_prices},
            "learner": {"kind": learner.kind, **learner.describe(), "files": files},
            "fixed": fixed_meta,
            "shipped": shipped,
            "lambda": lam,
            "floor": floor,
            "budget": budget,
            "objective": "accuracy - lambda * USD per query" + (
                f"; fixed action: the most accurate costing at most {budget:g} of the best single's USD on train"
                if budget is not None else
                "" if floor is None else f"; fixed action: the cheapest reaching the best single's accuracy "
                                         f"{floor:+g} on train"),
            "features": features.to_dict(),
            "actions": {
                "encoding": "key = '<shape>:<solver>+<solver>...[><finisher or escalation>...]'; "
                            "shapes single, verify, ensemble, cascade",
                "settings": action_settings.to_dict(),
                "by_task": {t: [a.key for a in acts] for t, acts in actions.items()},
            },
            "training": training,
            "checksums": _checksums(tmp),
        }
        # Number and rename under a lock-free retry: two trainings never share a version.
        for _ in range(100):
            version = next_version(base)
            meta["version"] = version
            (tmp / META_FILE).write_bytes(orjson.dumps(meta, option=orjson.OPT_INDENT_2))
            dest = base / f"v{version:04d}"
            try:
                os.rename(tmp, dest)
                return dest
            except OSError:
                if not dest.exists():
                    raise
        raise ConductorError(f"could not allocate a version folder under {base}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def next_version(base: Path) -> int:
    return max(versions(base), default=0) + 1


def versions(base: Path) -> list[int]:
    if not base.is_dir():
        return []
    return sorted(int(m.group(1)) for p in base.iterdir()
                  if (m := _VERSION_DIR.match(p.name)) and (p / META_FILE).exists())


def find(pool: Pool, where: str | Path | None = None) -> Path | None:
    """The artifact folder planning should use for `pool`, or None (plan with the prior).

    `where`: None for the default root; a root holding pool-key folders; a pool-key
    folder; or one version folder."""
    path = Path(where) if where is not None else default_root()
    if where is None and os.environ.get(POLICY_ENV) and not path.is_dir():
        _warn_missing_root(path)
    if (path / META_FILE).exists():
        return path
    for base in (path / pool_key(pool), path):
        vs = versions(base)
        if vs:
            return base / f"v{vs[-1]:04d}"
    if where is not None:
        _other_pools(path, pool)
    return None


def _warn_missing_root(path: Path) -> None:
    """$CONDUCTOR_POLICY_DIR naming no folder (a typo, a volume not mounted) planned with the prior
    without a word. Not refused: a first round of rollouts runs before training makes the folder."""
    if ("root", str(path)) not in _warned:
        _warned.add(("root", str(path)))
        print(f"conductor: warning: {POLICY_ENV}={path} is not a folder, so no learned policy is found there and "
              f"the embedded planner plans with its prior (before the first `conductor policy train` writes "
              f"it, that is expected; else set {POLICY_ENV} to the folder training writes to; to plan with the "
              f"prior on purpose: --planner-option policy=none, or --policy none to policy rollouts)",
              file=sys.stderr, flush=True)


def _other_pools(path: Path, pool: Pool) -> None:
    """A folder given by name that holds only other pools' artifacts: say whose, naming both pool
    keys, rather than let the caller say there is nothing under it (planning refuses it either way)."""
    others = []
    for sub in sorted(path.iterdir()) if path.is_dir() else []:
        vs = versions(sub)
        if sub.is_dir() and vs:
            try:
                meta = orjson.loads((sub / f"v{vs[-1]:04d}" / META_FILE).read_bytes())
                where = meta["pool"].get("path") or "pool file not recorded"
            except (OSError, orjson.JSONDecodeError, TypeError, KeyError, AttributeError):
                where = "policy.json unreadable"
            others.append(f"{sub.name} ({where}, {sub / f'v{vs[-1]:04d}'})")
    if others:
        raise ConductorError(f"policy {path} holds artifacts only for other pools: pool {'; pool '.join(others)}; "
                             f"not this pool ({pool_key(pool)}, {pool.path}); train one for this pool with "
                             f"`conductor policy train`, or pass the --pool it was trained for")


def read_meta(folder: Path) -> dict[str, Any]:
    path = Path(folder) / META_FILE
    try:
        meta = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        raise ConductorError(f"policy {folder}: no {META_FILE} (not a policy artifact folder)") from None
    except orjson.JSONDecodeError as e:
        raise ConductorError(f"policy {path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ConductorError(f"policy {path}: not a conductor policy (a JSON {type(meta).__name__}, not an object); "
                             f"restore the folder or retrain with `conductor policy train`")
    if meta.get("format") != FORMAT:
        raise ConductorError(f"policy {path}: not a conductor policy (format {meta.get('format')!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ConductorError(f"policy {path}: format version {meta.get('format_version')}, this conductor "
                             f"reads version {FORMAT_VERSION}; retrain with `conductor policy train`")
    _check(folder, meta)
    return meta


REQUIRED = (("pool", "key"), ("actions", "by_task"), ("learner", "kind"), ("features",), ("training",), ("lambda",))


def _checksums(folder: Path) -> dict[str, str]:
    """sha256 of each model file, so a file cut short by a copy is refused, not planned with."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).iterdir()) if p.is_file() and p.name != META_FILE}


def _check(folder: Path, meta: dict[str, Any]) -> None:
    path = Path(folder) / META_FILE
    for keys in REQUIRED:
        node: Any = meta
        for k in keys:
            if not isinstance(node, dict) or k not in node:
                raise ConductorError(f"policy {path}: incomplete, no {'.'.join(keys)}; retrain with "
                                     f"`conductor policy train` or restore the folder")
            node = node[k]
    if "checksums" not in meta:  # written before 2026-11-27: a model file cut short would plan without a word
        runs = " ".join(str(r.get("run_id")) for r in meta["training"].get("runs") or [] if isinstance(r, dict))
        raise ConductorError(f"policy {path}: no checksums (written before they were recorded), so a model file "
                             f"cut short by a copy cannot be told from a whole one; retrain it with `conductor "
                             f"policy train --runs {runs or 'RUN...'}` and the same options")
    metacheck.check(path, meta)
    for name, want in meta["checksums"].items():
        f = Path(folder) / name
        if not f.is_file():
            raise ConductorError(f"policy {folder}: {name} is missing")
        if hashlib.sha256(f.read_bytes()).hexdigest() != want:
            raise ConductorError(f"policy {f}: damaged (its checksum differs from the one training wrote, "
                                 f"{f.stat().st_size:,} bytes); copy the folder again or retrain")
    metacheck.check_saved(path, meta)


def check_workers(folder: Path, meta: dict[str, Any], pool: Pool) -> None:
    """Refuse actions naming a worker the pool lacks (the pool key matching, policy.json was
    edited): planning and `policy show` both say so."""
    keys = [k for keys in meta["actions"]["by_task"].values() for k in keys]
    missing = sorted({w for k in keys for w in Action.from_key(k).workers if not pool.has(w)})
    if missing:
        raise ConductorError(f"policy {folder}: actions use worker(s) {', '.join(missing)} missing from the pool")


def load(folder: Path, pool: Pool, use: str = "auto") -> Artifact:
    """Load and check an artifact against the pool it will plan for. `use`: auto (what
    training shipped), learned (the per-query learner) or fixed (the best fixed action)."""
    from conductor.policy.learner import load_learner

    folder = Path(folder)
    meta = read_meta(folder)
    wrong = mismatch(folder, meta, pool)
    if wrong:
        raise ConductorError(f"{wrong}; train one for this pool with `conductor policy train`")
    actions = {t: [Action.from_key(k) for k in keys] for t, keys in meta["actions"]["by_task"].items()}
    check_workers(folder, meta, pool)
    if use not in ("auto", "learned", "fixed"):
        raise ConductorError(f"planner option use={use!r}: choose auto, learned or fixed")
    which = meta.get("shipped", "learned") if use == "auto" else use  # checked by metacheck
    spec = meta["learner"]
    if which == "fixed" and spec["kind"] != "fixed":
        spec = meta.get("fixed")
        if spec is None:  # metacheck refuses this first; said plainly should it ever get here
            raise ConductorError(f"policy {folder}: {META_FILE} holds no fixed action (its field `fixed` is "
                                 f"empty), so it cannot plan with the fixed action; restore the folder or retrain "
                                 f"with `conductor policy train`")
    try:
        learner = load_learner(folder, spec)
    except (OSError, RuntimeError, ValueError, TypeError, KeyError) as e:
        raise ConductorError(f"policy {folder}: cannot load the model ({e})") from None
    return Artifact(folder, meta, learner, actions, FeatureSettings.from_dict(meta["features"]),
                    extra={"use": which, "price_changes": warn_prices(folder, meta, pool)})
