"""Type checks of a policy.json, field by field.

Every field a command reads is checked before it is used, so an edited or damaged file
(valid JSON, wrong content) is refused naming the file and the field, never a traceback
from deep in planning, `policy show` or `policy eval`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import orjson

from conductor.errors import ConductorError

KINDS = ("vw", "table", "fixed", "segment")
SHIPPED = ("learned", "fixed")
_FEATURES = {"bits": int, "max_chars": int, "length_buckets": bool}


class _Bad(Exception):
    def __init__(self, field: str, want: str, got: Any):
        super().__init__(field)
        self.field, self.want, self.got = field, want, got


def check(path: Path, meta: Any) -> None:
    """Raise a ConductorError naming `path` and the first field that is not what training writes."""
    try:
        _check(meta)
    except _Bad as e:
        _refuse(path, e)


def check_saved(path: Path, meta: dict) -> None:
    """After the model files' checksums: what policy.json says the fixed action is against the
    checksummed fixed.json that planning reads. An edited `fixed.choice` was shown by `policy
    show` as what planning uses, while planning used fixed.json's."""
    try:
        _saved_choice(Path(path).parent, meta)
    except _Bad as e:
        _refuse(path, e)


def _refuse(path: Path, e: _Bad) -> None:
    got = repr(e.got)
    got = got if len(got) <= 60 else got[:57] + "..."
    raise ConductorError(f"policy {path}: field {e.field} is {got}, expected {e.want}; the file was edited or "
                         f"damaged: restore the folder or retrain with `conductor policy train`") from None


def guarded(path: Path, field: str, fn: Callable[[], Any]) -> Any:
    """Run `fn` over a deep, descriptive part of the file (figures `policy show` prints); a part of
    another shape is refused by name instead of failing in a format string."""
    try:
        return fn()
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise ConductorError(f"policy {path}: field {field} is not what training writes ({type(e).__name__}: "
                             f"{e}); the file was edited or damaged: restore the folder or retrain") from None


def _check(meta: Any) -> None:
    _dict(meta, "(the whole file)")
    _int(meta.get("version"), "version", low=1)
    pool = _dict(meta.get("pool"), "pool")
    _str(pool.get("key"), "pool.key")
    _opt(pool.get("path"), "pool.path", _str)
    prices = pool.get("prices")
    if prices is not None:
        for w, p in _dict(prices, "pool.prices").items():
            if p is not None and not (isinstance(p, list) and len(p) == 2 and all(_num(x) for x in p)):
                raise _Bad(f"pool.prices.{w}", "null or [input, output] USD per token", p)
    learner = _learner(meta.get("learner"), "learner")
    fixed = meta.get("fixed")
    if fixed is not None:
        _learner(fixed, "fixed")
    elif learner["kind"] != "fixed":  # training saves it beside every other learner (format 2)
        raise _Bad("fixed", "the best fixed action training saved beside the learner (kind, name, choice, files)",
                   fixed)
    shipped = meta.get("shipped", "learned")
    if shipped not in SHIPPED:
        raise _Bad("shipped", " or ".join(map(repr, SHIPPED)), shipped)
    _number(meta.get("lambda"), "lambda", low=0)
    _opt(meta.get("floor"), "floor", _number)
    _opt(meta.get("budget"), "budget", _number)
    _opt(meta.get("objective"), "objective", _str)
    _features(_dict(meta.get("features"), "features"))
    _actions(_dict(meta.get("actions"), "actions"))
    training = _dict(meta.get("training"), "training")
    _training(training)
    _recorded(meta, training, shipped)
    sums = _dict(meta.get("checksums"), "checksums")
    for name, digest in sums.items():
        _str(digest, f"checksums.{name}")
    for part, spec in (("learner", learner), ("fixed", fixed or {})):
        for name in spec.get("files") or []:
            if name not in sums:
                raise _Bad("checksums", f"a sha256 for {part}.files {name!r}", sorted(sums))


def _recorded(meta: dict, t: dict, shipped: str) -> None:
    """The decision fields against what training recorded of them in the same file: an edited
    `shipped`, λ, floor or budget is valid on its own, so only the record tells it apart. A
    layout that lacks a record (an older training summary) has nothing to compare."""
    for field in ("lambda", "floor", "budget"):
        if field in t and t[field] != meta.get(field):
            raise _Bad(field, f"{t[field]!r}, the value training recorded (training.{field})", meta.get(field))
    sel = t.get("selection")
    if isinstance(sel, dict) and "shipped" in sel and sel["shipped"] != shipped:
        raise _Bad("shipped", f"{sel['shipped']!r}, the choice training recorded (training.selection.shipped); "
                   f"to plan with the other one, pass --planner-option use=learned or use=fixed", shipped)


def _saved_choice(folder: Path, meta: dict) -> None:
    from conductor.policy.learner import FixedLearner

    try:
        saved = orjson.loads((folder / FixedLearner.model_file).read_bytes())["choice"]
    except (OSError, orjson.JSONDecodeError, TypeError, KeyError):
        return  # no readable fixed.json: loading the model names it
    for part in ("learner", "fixed"):
        spec = meta.get(part)
        if not isinstance(spec, dict) or spec.get("kind") != "fixed":
            continue
        said = spec.get("choice")
        if said == saved:
            continue
        want = f"{FixedLearner.model_file}'s choice (which planning uses)"
        if isinstance(said, dict) and isinstance(saved, dict) and said.keys() == saved.keys():
            task = next(t for t in said if said[t] != saved[t])
            raise _Bad(f"{part}.choice.{task}", f"{saved[task]!r}, {want}", said[task])
        raise _Bad(f"{part}.choice", f"{saved!r}, {want}", said)


def _learner(spec: Any, field: str) -> dict:
    spec = _dict(spec, field)
    if spec.get("kind") not in KINDS:
        raise _Bad(f"{field}.kind", "one of " + ", ".join(KINDS), spec.get("kind"))
    _str(spec.get("name"), f"{field}.name")
    files = spec.get("files")
    if files is not None and not (isinstance(files, list) and all(isinstance(f, str) and f for f in files)):
        raise _Bad(f"{field}.files", "a list of file names", files)
    _opt(spec.get("settings"), f"{field}.settings", _dict)
    choice = spec.get("choice")
    if choice is not None:
        for task, key in _dict(choice, f"{field}.choice").items():
            _action(key, f"{field}.choice.{task}")
    _opt(spec.get("why"), f"{field}.why", _dict)
    return spec


def _features(f: dict) -> None:
    for k, t in _FEATURES.items():
        if k in f and (type(f[k]) is not t or (t is int and f[k] < 1)):
            raise _Bad(f"features.{k}", "a positive integer" if t is int else "true or false", f[k])
    for k in ("word_ngrams", "char_ngrams"):
        v = f.get(k, [1])
        if not (isinstance(v, list) and all(type(n) is int and n >= 1 for n in v)):
            raise _Bad(f"features.{k}", "a list of positive integers", v)
    _opt(f.get("group_by"), "features.group_by", _str)


def _actions(a: dict) -> None:
    by_task = _dict(a.get("by_task"), "actions.by_task")
    for task, keys in by_task.items():
        if not isinstance(keys, list):
            raise _Bad(f"actions.by_task.{task}", "a list of action keys", keys)
        for i, key in enumerate(keys):
            _action(key, f"actions.by_task.{task}[{i}]")


def _action(key: Any, field: str) -> None:
    from conductor.policy.actions import Action

    _str(key, field)
    try:
        Action.from_key(key)
    except ValueError:
        raise _Bad(field, "an action key such as single:w or cascade:a+b>c", key) from None


def _training(t: dict) -> None:
    _int(t.get("plans_used"), "training.plans_used", low=0)
    _int(t.get("queries"), "training.queries", low=0)
    _number(t.get("seconds"), "training.seconds", low=0)
    runs = t.get("runs")
    if not isinstance(runs, list):
        raise _Bad("training.runs", "a list of runs", runs)
    for i, r in enumerate(runs):
        _str(_dict(r, f"training.runs[{i}]").get("run_id"), f"training.runs[{i}].run_id")
    _opt(t.get("skipped"), "training.skipped", _dict)
    _opt(t.get("selection"), "training.selection", _dict)
    measured = t.get("measured")
    if measured is not None:
        for task, rows in _dict(measured, "training.measured").items():
            if not isinstance(rows, list):
                raise _Bad(f"training.measured.{task}", "a list of measured actions", rows)
            for i, r in enumerate(rows):
                f = f"training.measured.{task}[{i}]"
                _str(_dict(r, f).get("action"), f"{f}.action")
                _number(r.get("usd"), f"{f}.usd", low=0)
                _number(r.get("accuracy"), f"{f}.accuracy", low=0)


def _dict(v: Any, field: str) -> dict:
    if not isinstance(v, dict):
        raise _Bad(field, "an object", v)
    return v


def _str(v: Any, field: str) -> str:
    if not isinstance(v, str) or not v:
        raise _Bad(field, "a non-empty string", v)
    return v


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _number(v: Any, field: str, low: float | None = None) -> float:
    if not _num(v) or (low is not None and v < low):
        raise _Bad(field, "a finite number" + ("" if low is None else f" >= {low:g}"), v)
    return v


def _int(v: Any, field: str, low: int) -> int:
    if type(v) is not int or v < low:
        raise _Bad(field, f"an integer >= {low}", v)
    return v


def _opt(v: Any, field: str, fn: Callable[[Any, str], Any]) -> None:
    if v is not None:
        fn(v, field)
