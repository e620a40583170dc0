"""Job files: one YAML file per enrichment job (input table, prompt template,
output fields, references, pool and execution settings).

`load_job` refuses a bad file before anything is sent, naming the file, the
line and the key: an unknown column in the template, an unknown field type, an
enum without values, a missing id or reference column, a record column name that
another one repeats in any case (SQL ignores case), and so on. Duplicate ids, and
rows whose prompt is blank or too long to send, are found when the input is read
and rendered (`conductor.enrich.table`), still before any call.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import jinja2.nodes
import orjson

from conductor.enrich import inputs
from conductor.fields import ITEM_TYPES, TYPES, Field, object_schema
from conductor.enrich.marks import Located, load_located
from conductor.enrich.score import SCALES
from conductor.errors import ConductorError, InputError
from conductor.plans import MAX_STEPS
from conductor.yamlkeys import shown_value

TOP_KEYS = ("name", "description", "input", "prompt", "fields", "references", "pool", "mode", "worker",
            "planner", "budget_usd", "samples", "quality", "structured", "max_steps", "seed")
MODES = ("direct", "planned")
STRUCTURED = ("auto", "response_format", "prompt")
SCORES = ("exact", "numeric", "f1", "set", "tatqa")
# Columns every record has; no field, carried column or id may take these names, in any case
# (SQL ignores case). A plain-text job (no fields) also writes `text`.
RESERVED = ("status", "error", "cost_usd", "calls", "run_id", "reused", "row_hash", "updated_at", "score",
            "judge_score", "judge_reason", "judge_hash")
CATALOG_VIEWS = ("plans", "traces", "results", "rewards", "runs")
_NAME = re.compile(r"^[a-z][a-z0-9_]*\Z")
_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class Join:
    path: Path
    on: str


@dataclass(frozen=True)
class Reference:
    field: str
    column: str
    score: str
    rel_tol: float = 0.0
    scale_field: str | None = None  # tatqa: the field holding the predicted scale
    scale_column: str | None = None  # tatqa: the column holding the gold scale
    type_column: str | None = None  # tatqa: the gold answer type (arithmetic and count: F1 = EM)


@dataclass(frozen=True)
class Job:
    path: Path
    name: str
    description: str
    input_path: Path
    id_column: str
    joins: tuple[Join, ...]
    carry: tuple[str, ...]
    prompt: str
    template_names: tuple[str, ...]  # input columns the template reads, sorted
    fields: tuple[Field, ...]  # empty: a plain-text job (records carry `text`)
    references: dict[str, Reference]
    pool_path: Path
    mode: str
    worker: str | None
    planner: dict[str, Any]
    budget_usd: float | None
    samples: int
    quality: dict[str, Any]
    structured: str
    max_steps: int
    seed: int
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON Schema sent to providers (strict shape); None for a plain-text job."""
        return object_schema(self.fields, strict=True) if self.fields else None

    @property
    def check_schema(self) -> dict[str, Any] | None:
        """The JSON Schema every record is validated against: the one sent, so a record
        lists every field (an optional one may be null)."""
        return self.schema

    def pool_identity(self, pool: Any) -> str:
        """The part of the pool that decides this job's records: in direct mode its worker's model,
        endpoint and parameters only (another worker's edit left every row to be computed again,
        audit60 F5; the judge's worker has its own digest, `judge.judge_hash`, so changing it
        rescores without extracting); in planned mode every worker's, any of which a plan may use."""
        return pool.identity_hash() if self.mode == "planned" else pool.identity_hash(only=(self.worker,))

    def definition_hash(self, pool_identity: str = "") -> str:
        """What decides a row's record besides its content: template, fields, how it runs.
        References and quality settings are left out: changing them rescores, not recomputes."""
        ident = {"prompt": self.prompt, "schema": self.schema, "mode": self.mode, "worker": self.worker,
                 "planner": self.planner if self.mode == "planned" else None, "samples": self.samples,
                 "structured": self.structured, "max_steps": self.max_steps, "seed": self.seed,
                 "pool": pool_identity}
        return hashlib.sha256(orjson.dumps(ident, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def load_job(path: str | Path) -> Job:
    """Read and check a job file; raises InputError naming file, line and key."""
    path = Path(path)
    doc = load_located(path)
    raw = doc.data
    if not isinstance(raw, dict):
        raise doc.error((), "the top level must be a mapping (name, input, prompt, fields, pool, ...)")
    for k in raw:
        if k not in TOP_KEYS:
            raise doc.error((k,), f"unknown key (allowed: {', '.join(TOP_KEYS)})")
    base = path.parent
    name = _req(doc, raw, ("name",), str)
    if not _NAME.match(name):
        raise doc.error(("name",), f"{name!r}: use lower-case letters, digits and '_', starting with a letter")
    if name in CATALOG_VIEWS:
        raise doc.error(("name",), f"{name!r} is a catalog view already ({', '.join(CATALOG_VIEWS)}); rename the job")
    description = raw.get("description") or ""
    if not isinstance(description, str):
        raise doc.error(("description",), f"must be a string (got {description!r})")

    inp = _req(doc, raw, ("input",), dict)
    for k in inp:
        if k not in ("path", "id", "join", "carry"):
            raise doc.error(("input", k), "unknown key (allowed: path, id, join, carry)")
    input_path = base / _req(doc, inp, ("input", "path"), str)
    cols = _columns(doc, ("input", "path"), input_path)
    id_column = _req(doc, inp, ("input", "id"), str)
    if id_column not in cols:
        raise doc.error(("input", "id"), f"id column {id_column!r} is not in the input "
                                         f"(columns: {', '.join(cols)})")
    joins = []
    join_raw = inp.get("join") or []
    if not isinstance(join_raw, list):
        raise doc.error(("input", "join"), "must be a list of {path, on}")
    all_cols = list(cols)
    source = dict.fromkeys(cols, input_path)  # the file each column is read from (the input's own first)
    text_cols = set(cols) if inputs.is_csv(input_path) else set()  # CSV is read as written: text
    for i, j in enumerate(join_raw):
        at = ("input", "join", i)
        if isinstance(j, dict) and True in j:  # YAML 1.1 reads a bare `on` key as true
            j = {("on" if k is True else k): v for k, v in j.items()}
        if not isinstance(j, dict):
            raise doc.error(at, "must be a mapping with keys path and on")
        _no_unknown(doc, j, at, ("path", "on"))
        jpath = base / _req(doc, j, at + ("path",), str)
        on = _req(doc, j, at + ("on",), str)
        jcols = _columns(doc, at + ("path",), jpath)
        for where, have in (("the input", all_cols), (str(jpath), jcols)):
            if on not in have:
                raise doc.error(at + ("on",), f"join column {on!r} is not in {where} (columns: {', '.join(have)})")
        if inputs.is_csv(jpath):
            text_cols |= {c for c in jcols if c not in all_cols}
        source.update({c: jpath for c in jcols if c not in source})
        all_cols += [c for c in jcols if c not in all_cols]
        joins.append(Join(jpath, on))
    carry = inp.get("carry") or []
    if not isinstance(carry, list) or not all(isinstance(c, str) for c in carry):
        raise doc.error(("input", "carry"), "must be a list of column names")
    for i, c in enumerate(carry):
        if c not in all_cols:
            raise doc.error(("input", "carry", i), f"column {c!r} is not in the input (columns: {', '.join(all_cols)})")
        if c == id_column:  # it was dropped in silence (audit75 F6)
            raise doc.error(("input", "carry", i), f"{c!r} is the id column, which every record holds already; "
                                                   f"remove it from carry")

    prompt = _req(doc, raw, ("prompt",), str)
    names = _template_names(doc, prompt, all_cols)
    _refuse_numbers_from_text(doc, prompt, text_cols - {id_column})

    if "fields" in raw and raw["fields"] is None:  # `fields:` with every entry commented out
        raise doc.error(("fields",), "is empty (every field commented out?); give at least one field, or "
                                     "remove the `fields` key for a plain-text job")
    fields = _fields(doc, raw.get("fields"), ("fields",))
    _check_column_names(doc, id_column, carry, fields)
    references = _references(doc, raw.get("references"), fields, source)

    pool_path = base / _req(doc, raw, ("pool",), str)
    mode = raw.get("mode", "direct")
    if mode not in MODES:
        raise doc.error(("mode",), f"{mode!r}: must be one of {', '.join(MODES)}")
    worker = raw.get("worker")
    if mode == "direct" and raw.get("planner") is not None:
        # planned mode refuses `worker:`; direct mode dropped a planner (and its typos) in silence
        raise doc.error(("planner",), "only planned mode takes a planner; direct mode sends the prompt to its "
                                      "worker as it is (set mode: planned to use the planner, or remove the key)")
    planner = raw.get("planner") or {"name": "embedded"}
    if not isinstance(planner, dict) or not isinstance(planner.get("name", "embedded"), str):
        raise doc.error(("planner",), "must be a mapping like {name: embedded} with the planner's options")
    from conductor.planners import PLANNERS

    if planner.get("name", "embedded") not in PLANNERS:
        raise doc.error(("planner", "name"), f"{planner.get('name')!r}: must be one of {', '.join(PLANNERS)}")
    quality = raw.get("quality") or {}
    if not isinstance(quality, dict):
        raise doc.error(("quality",), "must be a mapping (min_valid_share, judge)")
    _no_unknown(doc, quality, ("quality",), ("min_valid_share", "judge"))
    if isinstance(quality.get("judge"), dict):
        _no_unknown(doc, quality["judge"], ("quality", "judge"), ("worker", "rubric"))
    pool = _check_pool(doc, pool_path, mode, worker, raw)
    max_steps = _int(doc, raw, "max_steps", 5, maximum=MAX_STEPS)
    seed = _int(doc, raw, "seed", 0, minimum=0)
    if mode == "direct":  # one step, one worker: neither bounds nor draws anything there
        for key, what in (("max_steps", "the most steps a plan may take"), ("seed", "the planner's draws")):
            if raw.get(key) is not None:
                raise doc.error((key,), f"only planned mode takes {key} ({what}); direct mode sends one call "
                                        f"per row, so it would change nothing: remove the key")
    if mode == "planned":
        _check_planner(doc, planner, pool, max_steps)
    structured = raw.get("structured", "auto")
    if structured not in STRUCTURED:
        raise doc.error(("structured",), f"{structured!r}: must be one of {', '.join(STRUCTURED)}")
    budget = raw.get("budget_usd")
    if budget is not None and (not _finite(budget) or budget < 0):
        raise doc.error(("budget_usd",), f"must be a finite number >= 0 (got {shown_value(budget)})")
    _check_prices(doc, pool, worker if mode == "direct" else None, quality.get("judge"), budget)
    from conductor.runner import MAX_SAMPLES

    samples = _int(doc, raw, "samples", 1, maximum=MAX_SAMPLES)
    if mode == "direct" and samples > 1:
        raise doc.error(("samples",), "direct mode sends every sample of a row the same request, so each sample "
                                      "after sample 0 is the response cache's copy of its reply (an invalid one "
                                      "too) and adds nothing; set samples: 1 (or leave it out), or use mode: "
                                      "planned, whose samples are plans of their own")
    share = quality.get("min_valid_share", 0.95)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise doc.error(("quality", "min_valid_share"), f"must be a number in [0, 1] (got {share!r})")
    return Job(
        path=path, name=name, description=str(description), input_path=input_path, id_column=id_column,
        joins=tuple(joins), carry=tuple(carry), prompt=prompt, template_names=tuple(sorted(names)),
        fields=fields, references=references, pool_path=pool_path, mode=mode, worker=worker,
        planner=dict(planner), budget_usd=None if budget is None else float(budget), samples=samples,
        quality={**quality, "min_valid_share": float(share)}, structured=structured,
        max_steps=max_steps, seed=seed, raw=raw)


def _check_column_names(doc: Located, id_column: str, carry: list[str], fields: tuple[Field, ...]) -> None:
    """Every column of the records needs a name of its own, ignoring case: DuckDB (the catalog
    view, and `published` read through it) takes `Status` and `status` for one name and renames
    one of them, so `status` in SQL would read the wrong column. Refused at the later name's key."""
    held: dict[str, tuple[str, tuple, str]] = {r: (r, (), f"the record column {r!r}") for r in RESERVED}
    if not fields:
        held["text"] = ("text", (), "the column 'text', where a job without fields writes its output")

    def claim(name: str, key: tuple, what: str) -> None:
        if (other := held.get(name.lower())) is not None:
            if other[0] == name and other[1][:2] == key[:2] == ("input", "carry"):
                raise doc.error(key, f"{what} is listed twice; keep one")
            case = " (SQL ignores case)" if other[0] != name else ""
            raise doc.error(key, f"{what} clashes with {other[2]}{case}; rename it")
        held[name.lower()] = (name, key, what)

    claim(id_column, ("input", "id"), f"id column {id_column!r}")
    for i, c in enumerate(carry):
        claim(c, ("input", "carry", i), f"carried column {c!r}")
    for f in fields:
        claim(f.name, ("fields", f.name), f"field {f.name!r}")
    for f in fields:  # each field also gets a confidence column
        conf = f"{f.name}_confidence"
        if (other := held.get(conf.lower())) is not None:
            _, key, what = other
            if key[:2] == ("input", "id") or not key:  # the id is named by the input: rename the field
                raise doc.error(("fields", f.name), f"its confidence column {conf!r} clashes with {what}; "
                                                    f"rename the field")
            raise doc.error(key, f"{what} clashes with the confidence column of field {f.name!r}; rename it")
        held[conf.lower()] = (conf, ("fields", f.name), f"the confidence column of field {f.name!r}")


def template_env() -> jinja2.Environment:
    """Strict: a name the row does not have is an error, never an empty string.
    A null value renders as an empty string."""
    return jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False,
                              finalize=lambda v: "" if v is None else v)


def _template_names(doc: Located, prompt: str, columns: list[str]) -> set[str]:
    env = template_env()
    first = _prompt_line(doc)
    try:
        ast = env.parse(prompt)
        env.compile(ast)  # an unknown filter or test is found here, not by the parser
    except jinja2.TemplateSyntaxError as e:
        line = first + (e.lineno or 1) - 1
        raise InputError(f"job file {doc.path}:{line}: prompt: template syntax error: {e.message}") from None
    names = jinja2.meta.find_undeclared_variables(ast)
    unknown = sorted(n for n in names if n not in columns)
    if unknown:
        where = {}
        for node in ast.find_all(jinja2.nodes.Name):
            if node.name in unknown and node.ctx == "load":
                where.setdefault(node.name, node.lineno)
        n = unknown[0]
        line = first + where.get(n, 1) - 1
        more = f" (also unknown: {', '.join(unknown[1:])})" if len(unknown) > 1 else ""
        raise InputError(f"job file {doc.path}:{line}: prompt: template reads column {n!r}, which the input "
                         f"does not have{more} (columns: {', '.join(columns)})")
    return set(names)


_ARITHMETIC = (jinja2.nodes.Add, jinja2.nodes.Sub, jinja2.nodes.Mul, jinja2.nodes.Div, jinja2.nodes.FloorDiv,
               jinja2.nodes.Mod, jinja2.nodes.Pow, jinja2.nodes.Neg, jinja2.nodes.Pos)
_ORDER = ("gt", "gteq", "lt", "lteq")
_ORDERING_FILTERS = ("max", "min", "sort")
# Filters that compute with what they are given: on text, a TypeError when the row is rendered.
_ARITHMETIC_FILTERS = ("abs", "round", "sum")
# Filters whose result is a number, not the text they were given (`| float`, `| length`): what
# comes out of any other filter (`| trim`, `| default('0')`, `| first`) is still the CSV's text.
_NUMBER_FILTERS = ("float", "int", "length", "count", "wordcount", "abs", "round", "sum")
# Methods of a string that give a number or a truth value rather than text.
_NUMBER_METHODS = ("count", "find", "rfind", "index", "rindex", "isdigit", "isnumeric", "isdecimal", "isalpha",
                   "isalnum", "isspace", "islower", "isupper", "startswith", "endswith")


def _refuse_numbers_from_text(doc: Located, prompt: str, text_cols: set[str]) -> None:
    """A CSV column is text as written, so the template must convert it to compute with it: on
    text, `amount * 2` repeats the string ('12.5012.50'), `qty == 0` is never true, and `a > b`
    and `[a, b] | max` compare letters, all silently. Refused where a CSV column is an operand as it
    is (not through a filter such as `| float`), or a name that holds it: `{% set a = amount %}`,
    `{% for x in [a, b] %}`, `{% with %}`, a macro's argument (audit60 F4), naming the column and
    the line. Names are followed by name, whatever their scope: one bound from a CSV column
    anywhere counts as text everywhere."""
    if not text_cols:
        return
    N = jinja2.nodes
    ast = template_env().parse(prompt)
    held: dict[str, str] = {c: c for c in text_cols}  # name -> the CSV column whose text it holds

    def text_of(node: Any) -> str | None:
        """The CSV column whose text the expression may give (as text), or None."""
        if node is None or isinstance(node, (N.Const, N.Compare, N.Not, N.Test, N.TemplateData)):
            return None
        if isinstance(node, N.Name):
            return held.get(node.name)
        if isinstance(node, N.NSRef):
            return held.get(node.name)
        if isinstance(node, N.Filter):
            if node.name in _NUMBER_FILTERS:
                return None
            if node.name == "map" and node.args and isinstance(node.args[0], N.Const) \
                    and node.args[0].value in _NUMBER_FILTERS:
                return None
            return next(filter(None, map(text_of, [node.node, *node.args, *(k.value for k in node.kwargs)])),
                        None)
        if isinstance(node, N.CondExpr):
            return text_of(node.expr1) or text_of(node.expr2)
        if isinstance(node, (N.Getattr, N.Getitem)):
            return text_of(node.node)
        if isinstance(node, N.Call):
            if isinstance(node.node, N.Getattr) and node.node.attr in _NUMBER_METHODS:
                return None
            return next(filter(None, map(text_of, [node.node, *node.args, *(k.value for k in node.kwargs),
                                                   node.dyn_args, node.dyn_kwargs])), None)
        return next(filter(None, map(text_of, node.iter_child_nodes())), None)

    def names(target: Any) -> list[str]:
        if isinstance(target, (N.Name, N.NSRef)):
            return [target.name]
        return [n for item in getattr(target, "items", []) for n in names(item)]

    def hold(target: Any, col: str | None) -> bool:
        new = [n for n in names(target) if col and n not in held]
        for n in new:
            held[n] = col  # type: ignore[assignment]
        return bool(new)

    macros = {m.name: m for m in ast.find_all(N.Macro)}
    grew = True
    while grew:  # a name bound from a name bound from a column: until nothing new is found
        grew = False
        for node in ast.find_all((N.Assign, N.For)):
            grew |= hold(node.target, text_of(node.node if isinstance(node, N.Assign) else node.iter))
        for node in ast.find_all(N.AssignBlock):
            grew |= hold(node.target, next(filter(None, (text_of(x) for o in node.find_all(N.Output)
                                                         for x in o.nodes)), None))
        for node in ast.find_all(N.With):
            for target, value in zip(node.targets, node.values):
                grew |= hold(target, text_of(value))
        for call in ast.find_all(N.Call):
            m = macros.get(call.node.name) if isinstance(call.node, N.Name) else None
            if m is None:
                continue
            for param, arg in zip(m.args, call.args):
                grew |= hold(param, text_of(arg))
            for kw in call.kwargs:
                grew |= hold(N.Name(kw.key, "param"), text_of(kw.value))
        for m in macros.values():  # a default value: `{% macro f(x=amount) %}`
            for param, default in zip(m.args[len(m.args) - len(m.defaults):], m.defaults):
                grew |= hold(param, text_of(default))

    found: list[tuple[str, str, int, str]] = []  # (column, name it is read through, line, how)
    for node in ast.find_all(_ARITHMETIC):
        for operand in (getattr(node, "left", None), getattr(node, "right", None), getattr(node, "node", None)):
            if operand is not None and (col := text_of(operand)):
                found.append((col, _read_as(operand), node.lineno, "in arithmetic"))
    for node in ast.find_all(N.Filter):  # `amount | round` raised a TypeError at render (audit75 F7)
        if node.name in _ARITHMETIC_FILTERS and (col := text_of(node.node)):
            found.append((col, _read_as(node.node), node.lineno, f"given to `{node.name}`, which takes a number"))
    for node in ast.find_all(N.Filter):  # `[a, b] | max` orders text as text too
        if node.name in _ORDERING_FILTERS and node.node is not None:
            items = node.node.items if isinstance(node.node, (N.List, N.Tuple)) else [node.node]
            for item in items:
                if col := text_of(item):
                    found.append((col, _read_as(item), node.lineno, f"ordered with `{node.name}`"))
    for node in ast.find_all(N.Compare):
        sides = [node.expr, *(op.expr for op in node.ops)]
        numeric = any(isinstance(x, N.Const) and isinstance(x.value, (int, float))
                      and not isinstance(x.value, bool) for x in sides)
        ordered = any(op.op in _ORDER for op in node.ops)
        for x in sides:
            if (numeric or ordered) and (col := text_of(x)):
                found.append((col, _read_as(x), node.lineno, "compared as a number"))
    if found:
        col, name, lineno, how = min(found, key=lambda f: f[2])
        line = _prompt_line(doc) + lineno - 1
        through = f" (read as {name!r})" if name is not None and name != col else ""
        raise InputError(f"job file {doc.path}:{line}: prompt: column {col!r}{through} is {how}, but a CSV input "
                         f"is read as text, exactly as written; convert it in the template, e.g. "
                         f"{{{{ {col} | float }}}} or {{{{ {col} | int }}}}")


def _read_as(node: Any) -> str | None:
    """The name an operand reads its value through (`a` in `a * 2`, `ns.total`), if it is one."""
    if isinstance(node, (jinja2.nodes.Name, jinja2.nodes.NSRef)):
        return node.name
    if isinstance(node, jinja2.nodes.Getattr) and isinstance(node.node, jinja2.nodes.Name):
        return f"{node.node.name}.{node.attr}"
    return None


def _prompt_line(doc: Located) -> int:
    """File line of the template's first line: a block scalar (| or >) starts on the next line."""
    line = doc.line("prompt", "<value>") or doc.line("prompt") or 1
    return line + 1 if doc.styles.get(("prompt",)) in ("|", ">") else line


def _fields(doc: Located, raw: Any, at: tuple) -> tuple[Field, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise doc.error(at, "must be a mapping of field name to {type, description, required}")
    if not raw:  # `{}` is a mapping: "must be a mapping" read as wrong (audit66 F8)
        raise doc.error(at, "is empty; give at least one field, or remove the `fields` key for a plain-text job"
                        if at == ("fields",) else "is empty; an object needs at least one field")
    out = []
    for name, spec in raw.items():
        fat = at + (name,)
        if not isinstance(name, str) or not _FIELD.match(name):
            raise doc.error(fat, f"field name {name!r}: use letters, digits and '_'")
        if isinstance(spec, str):
            spec = {"type": spec}
        if not isinstance(spec, dict):
            raise doc.error(fat, "must be a mapping like {type: string, description: ..., required: true}")
        for k in spec:
            if k not in ("type", "description", "required", "values", "items", "fields"):
                raise doc.error(fat + (k,), "unknown key (allowed: type, description, required, values, items, fields)")
        t = spec.get("type")
        if t is None:  # left out, or `type:` with no value: "unknown field type None" named no mistake
            raise doc.error(fat + ("type",), f"required (one of {', '.join(TYPES)})")
        if t not in TYPES:
            raise doc.error(fat + ("type",), f"unknown field type {t!r} (allowed: {', '.join(TYPES)})")
        values: tuple = ()
        if t == "enum":
            v = spec.get("values")
            if not isinstance(v, list) or not v:
                raise doc.error(fat + ("values",) if "values" in spec else fat,
                                "an enum needs values: a non-empty list, e.g. values: [low, high]")
            if len(set(map(str, v))) != len(v):
                raise doc.error(fat + ("values",), "values repeat")
            if not all(isinstance(x, str) for x in v):  # records hold an enum as text
                odd = next(x for x in v if not isinstance(x, str))
                kind = type(odd).__name__
                what = "an empty value as null" if odd is None else \
                    f"{odd!r} as {'an' if kind[0] in 'aeiou' else 'a'} {kind}"
                raise doc.error(fat + ("values",), f"values must be text, and YAML reads {what}: quote them, "
                                                   f"e.g. values: [\"yes\", \"no\"]")
            values = tuple(v)
        elif "values" in spec:
            raise doc.error(fat + ("values",), f"only an enum takes values (this field is {t})")
        for key, kind in (("items", "list"), ("fields", "object")):
            if key in spec and t != kind:  # `type: string` where `list` or `object` was meant
                raise doc.error(fat + (key,), f"only {'a list' if kind == 'list' else 'an object'} takes {key} "
                                              f"(this field is {t})")
        items = spec.get("items", "string")
        if t == "list" and items not in ITEM_TYPES:
            raise doc.error(fat + ("items",), f"unknown item type {items!r} (allowed: {', '.join(ITEM_TYPES)})")
        sub: tuple[Field, ...] = ()
        if t == "object":
            if not spec.get("fields"):
                raise doc.error(fat, "an object needs fields: a mapping of name to type")
            sub = _fields(doc, spec["fields"], fat + ("fields",))
        required = spec.get("required", False)
        if not isinstance(required, bool):
            raise doc.error(fat + ("required",), f"must be true or false (got {required!r})")
        description = spec.get("description") or ""
        if not isinstance(description, str):  # `5` was sent as "5", `[a, b]` as "['a', 'b']" (audit75 F6)
            raise doc.error(fat + ("description",), f"must be a string (got {shown_value(description)}); "
                                                    f"quote it if it is meant as text")
        out.append(Field(name, t, description, required, values, items, sub))
    return tuple(out)


def _references(doc: Located, raw: Any, fields: tuple[Field, ...], source: dict[str, Path]) -> dict[str, Reference]:
    """Each key a reference takes is read by its scorer or refused at its line: a key another
    scorer reads (rel_tol, the tatqa keys) was ignored in silence (audit75 F6, fix42h)."""
    if raw is None:
        return {}
    at = ("references",)
    if not isinstance(raw, dict):
        raise doc.error(at, "must be a mapping of field name to {column, score}")
    if not fields:
        raise doc.error(at, "a job without fields has nothing to score against references")
    by_name = {f.name: f for f in fields}
    columns = list(source)
    out = {}
    for name, spec in raw.items():
        rat = at + (name,)
        if name not in by_name:
            raise doc.error(rat, f"{name!r} is not a field (fields: {', '.join(by_name)})")
        if not isinstance(spec, dict):
            raise doc.error(rat, "must be a mapping like {column: gold, score: exact}")
        allowed = ("column", "score", "rel_tol", "scale_field", "scale_column", "type_column")
        for k in spec:
            if k not in allowed:
                raise doc.error(rat + (k,), f"unknown key (allowed: {', '.join(allowed)})")
        column = _req(doc, spec, rat + ("column",), str)
        if column not in columns:
            raise doc.error(rat + ("column",), f"reference column {column!r} is not in the input "
                                               f"(columns: {', '.join(columns)})")
        score = spec.get("score", "exact")
        if score not in SCORES:
            raise doc.error(rat + ("score",), f"unknown score {score!r} (allowed: {', '.join(SCORES)})")
        tol = spec.get("rel_tol", 0.0)
        if not _finite(tol) or tol < 0:
            raise doc.error(rat + ("rel_tol",), f"must be a finite number >= 0 (got {shown_value(tol)})")
        if "rel_tol" in spec and score != "numeric":  # it was ignored in silence (audit75 F6)
            raise doc.error(rat + ("rel_tol",), f"only score: numeric takes rel_tol (this reference is scored "
                                                f"{score}, which does not use it); set score: numeric, or remove "
                                                f"rel_tol")
        kind = by_name[name].type
        if score == "numeric" and kind in _NOT_NUMBERS:  # every row scored 0, in silence
            raise doc.error(rat + ("score",), f"score: numeric compares numbers, and field {name!r} is a {kind}, "
                                              f"which is never read as one: every row would score 0; use score: "
                                              f"{'set' if kind == 'list' else 'exact'}")
        sf, sc, tc = _tatqa_keys(doc, spec, rat, score, by_name, source)
        out[name] = Reference(name, column, score, float(tol), sf, sc, tc)
    return out


# Field types `numeric` never reads a number from (score.to_number of a list, an object, true, a date).
_NOT_NUMBERS = ("list", "object", "boolean", "date")
_TATQA_KEYS = {"scale_field": "a field", "scale_column": "an input column", "type_column": "an input column"}
_SCALES = ", ".join(repr(s) if not s else s for s in SCALES)  # '', thousand, million, billion, percent


def _tatqa_keys(doc: Located, spec: dict, rat: tuple, score: str, by_name: dict[str, Field],
                source: dict[str, Path]) -> tuple[str | None, str | None, str | None]:
    """scale_field, scale_column and type_column: only tatqa reads them. TAT-QA compares an answer
    written out with its scale on both sides, so the record's scale (an enum of TAT-QA's scales:
    another value counted as none) and the gold scale come together or not at all; with one side
    only, a right answer with a scale counted wrong."""
    got: dict[str, str] = {}
    for key, what in _TATQA_KEYS.items():
        if key not in spec:
            continue
        if score != "tatqa":
            raise doc.error(rat + (key,), f"only score: tatqa takes {key} (this reference is scored {score}, "
                                          f"which does not use it); set score: tatqa, or remove {key}")
        v = spec[key]
        if not isinstance(v, str) or not v.strip():
            raise doc.error(rat + (key,), f"must be the name of {what} (got {shown_value(v)})")
        have = by_name if key == "scale_field" else source
        if v not in have:
            raise doc.error(rat + (key,), f"{v!r} is not {'a field' if key == 'scale_field' else 'in the input'} "
                                          f"({'fields' if key == 'scale_field' else 'columns'}: {', '.join(have)})")
        got[key] = v
    sf, sc, tc = got.get("scale_field"), got.get("scale_column"), got.get("type_column")
    if sf is not None:
        f = by_name[sf]
        if f.type != "enum":
            raise doc.error(rat + ("scale_field",), f"field {sf!r} is a {f.type}; the record's scale must be an "
                                                    f"enum field of TAT-QA's scales ({_SCALES}), e.g. {{type: enum, "
                                                    f"values: [\"\", thousand, million, billion, percent]}}")
        if odd := [v for v in f.values if v not in SCALES]:
            raise doc.error(rat + ("scale_field",), f"field {sf!r} has values that are not TAT-QA's scales "
                                                    f"({', '.join(map(repr, odd))}): a record giving one would "
                                                    f"count as having no scale; keep its values among {_SCALES}")
    # a scale on one side only is allowed: the other side may be written out in full units already
    if sc is not None:
        try:
            bad = inputs.values_outside(source[sc], sc, tuple(SCALES))
        except InputError as e:
            raise doc.error(rat + ("scale_column",), str(e)) from None
        if bad:
            raise doc.error(rat + ("scale_column",), f"column {sc!r} of {source[sc]} {bad}; TAT-QA's scales are "
                                                     f"{_SCALES}, and a row's answer with another would count as "
                                                     f"having no scale; write each as one of those")
    return sf, sc, tc


def _check_pool(doc: Located, pool_path: Path, mode: str, worker: Any, raw: dict) -> Any:
    from conductor.pool import load_pool

    try:
        pool = load_pool(pool_path)
    except ConductorError as e:
        raise doc.error(("pool",), str(e)) from None
    if mode == "direct":
        if not isinstance(worker, str):
            raise doc.error(("worker",) if "worker" in raw else ("mode",),
                            f"direct mode needs worker: one of {', '.join(pool.ids)}")
        if not pool.has(worker):
            raise doc.error(("worker",), f"{worker!r} is not in pool {pool_path} (workers: {', '.join(pool.ids)})")
        if pool.worker(worker).kind != "llm":
            raise doc.error(("worker",), f"{worker!r} is a {pool.worker(worker).kind} worker; direct mode needs an llm")
    elif worker is not None:
        raise doc.error(("worker",), "only direct mode takes a worker; planned mode uses planner")
    judge = (raw.get("quality") or {}).get("judge") if isinstance(raw.get("quality"), dict) else None
    if judge is not None:
        if not isinstance(judge, dict) or not isinstance(judge.get("worker"), str):
            raise doc.error(("quality", "judge"), "must be a mapping {worker, rubric}")
        if not pool.has(judge["worker"]):
            raise doc.error(("quality", "judge", "worker"), f"{judge['worker']!r} is not in pool {pool_path}")
        if pool.worker(judge["worker"]).kind != "llm":
            raise doc.error(("quality", "judge", "worker"), f"{judge['worker']!r} is not an llm worker")
        if not isinstance(judge.get("rubric"), str) or not judge["rubric"].strip():
            raise doc.error(("quality", "judge", "rubric") if "rubric" in judge else ("quality", "judge"),
                            "the judge needs a rubric: what a good record is, in a few sentences")
    return pool


def _check_planner(doc: Located, planner: dict, pool: Any, max_steps: int) -> None:
    """The planner as the run builds it (its factory, with the job's max_steps for a model planner,
    as runner.configured_planner gives it) and, for a planner calling a worker, that worker in the
    pool: `job check` refuses what `job run` would, with the file and line. Building one loads
    nothing. The key named is the first option refused on its own, else `max_steps` or `planner`."""
    from conductor.planners import make_planner
    from conductor.runner import close_planner

    name = planner.get("name", "embedded")
    options = {k: v for k, v in planner.items() if k != "name"}
    if odd := [k for k in options if not isinstance(k, str)]:  # YAML reads `1:` or `on:` as a number or bool
        raise doc.error(("planner", str(odd[0])), "an option name must be text")
    given = options.get("max_steps", max_steps)
    if name in ("vllm", "llm") and (isinstance(given, bool) or given != max_steps):
        # as runner.check_max_steps_option refuses it at run time, in the job file's words
        raise doc.error(("planner", "max_steps"), f"planner.max_steps {shown_value(given)} differs from the job's "
                        f"max_steps {max_steps}, against which plans are checked: longer plans would be paid for, "
                        f"then thrown away; set the job's max_steps and drop planner.max_steps")
    steps = {"max_steps": max_steps} if name in ("vllm", "llm") and "max_steps" not in options else {}
    full = {**steps, **options}

    def refused(given: dict) -> ConductorError | None:
        try:
            built = make_planner(name, **given)
        except ConductorError as e:
            return e
        try:
            if given is full and hasattr(built, "resolve"):
                built.resolve(pool)  # the planner's worker: in the pool, of kind planner
        except ConductorError as e:
            return e
        finally:
            close_planner(built)
        return None

    if (e := refused(full)) is None:
        return
    key: tuple = ("planner",)
    if refused({}) is None:
        if steps and refused(steps) is not None:
            key = ("max_steps",)
        elif (k := next((k for k in options if refused({k: options[k]}) is not None), None)) is not None:
            key = ("planner", k)
        elif "worker" in options:
            key = ("planner", "worker")
    raise doc.error(key, str(e))


def _check_prices(doc: Located, pool: Any, worker: str | None, judge: Any, budget: Any) -> None:
    """Under a budget (the job's, or its provider's) a worker needs a known price, or the run
    refuses it after planning (`runner.check_ready`, whose rule this is): refused here, before
    any run folder, naming the key. Planned mode's workers are known only once planned."""
    from conductor.execute.prices import resolve_price

    judge_worker = judge.get("worker") if isinstance(judge, dict) else None
    for key, wid in ((("worker",), worker), (("quality", "judge", "worker"), judge_worker)):
        if wid is None:
            continue
        w = pool.worker(wid)
        provider = pool.providers.get(w.provider)
        capped = budget is not None or (provider is not None and provider.budget_usd is not None)
        if capped and w.kind != "function" and w.model and resolve_price(w) is None:
            by = "the job's budget_usd" if budget is not None else f"provider {w.provider}'s budget_usd"
            raise doc.error(key, f"worker {wid!r} has no known price, so it cannot run under {by}; add "
                                 f"price: {{input_per_mtok, output_per_mtok}} to it in pool {pool.path}")


def _columns(doc: Located, at: tuple, path: Path) -> list[str]:
    try:
        return inputs.columns(path)
    except InputError as e:
        raise doc.error(at, str(e)) from None


def _req(doc: Located, d: dict, key: tuple, kind: type) -> Any:
    v = d.get(key[-1])
    if v is None:
        raise doc.error(key, "required")
    if not isinstance(v, kind) or (kind is str and not v.strip()):
        raise doc.error(key, f"must be a {'mapping' if kind is dict else 'non-empty string'} (got {v!r})")
    return v


def _no_unknown(doc: Located, d: dict, at: tuple, allowed: tuple[str, ...]) -> None:
    for k in d:
        if k not in allowed:
            raise doc.error(at + (k,), f"unknown key (allowed: {', '.join(allowed)})")


def _finite(v: Any) -> bool:
    """A number a float holds: YAML's .nan and .inf are not, nor an integer of 400 digits
    (float() of it overflows)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _int(doc: Located, raw: dict, key: str, default: int | None, minimum: int = 1,
         maximum: int = 2 ** 63 - 1) -> Any:
    """An integer setting; at most 2**63 - 1 by default, the most a run's definition hash
    (orjson) and `--seed` take."""
    v = raw.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= maximum:
        raise doc.error((key,), f"must be an integer from {minimum} to {maximum} (got {shown_value(v)})")
    return v
