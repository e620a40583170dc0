"""Scoring a record's fields against reference columns.

exact    equal after normalization (lower case, no punctuation, articles or extra spaces)
numeric  equal within `rel_tol` of the reference
f1       token F1 of the normalized texts (spans)
set      the normalized items, as sets, are equal (lists); `jaccard` reported too
tatqa    TAT-QA's own metric: answers (a list of spans or one number) are written out
         with their scale, numbers rounded to 2 decimals and multiplied by the scale
         (percent: 0.01, as TAT-QA's scale_to_num; "12%" is 0.12),
         then compared by exact match and bag-of-tokens F1 after normalization; so a
         number counts only with the right scale. For arithmetic and count answers F1
         equals exact match. The field's score is the exact match; F1 is reported.

Each scorer returns {"score": float in [0, 1], ...}; None when there is no reference.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from datetime import date
from typing import Any

import orjson

from conductor.fields import Field

SCALES = {"": 1.0, "thousand": 1e3, "million": 1e6, "billion": 1e9, "percent": 0.01}  # TAT-QA's scale_to_num
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def reference_value(f: Field, v: Any) -> Any:
    """A reference column's value as the field's type (what a perfect record holds)."""
    if v is None:
        return None
    if isinstance(v, str) and f.type in ("list", "object", "number", "integer", "boolean"):
        try:
            v = orjson.loads(v)
        except orjson.JSONDecodeError:
            pass
    if f.type == "list":
        return [_item(x) for x in v] if isinstance(v, (list, tuple)) else [_item(v)]
    if f.type == "string":
        return ", ".join(map(_item, v)) if isinstance(v, (list, tuple)) else _item(v)
    if f.type in ("number", "integer"):
        n = to_number(v) if not isinstance(v, bool) else None
        return None if n is None else (int(round(n)) if f.type == "integer" else n)
    if f.type == "boolean":
        return v if isinstance(v, bool) else str(v).strip().lower() in ("true", "yes", "1")
    if f.type == "date":
        return v.isoformat() if isinstance(v, date) else str(v)
    if f.type == "enum":
        return v if v in f.values else str(v)
    return v


def _item(x: Any) -> str:
    return x if isinstance(x, str) else orjson.dumps(x).decode() if isinstance(x, (dict, list)) else str(x)


def normalize(s: Any) -> str:
    s = str(s).lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def to_number(v: Any) -> float | None:
    """A number from 12, '1,496.5', '$ 3.2', '(44.1)', '12%'; None if it is not one."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if not isinstance(v, str):
        return None
    s = v.strip().replace(",", "").replace("$", "").replace("%", "").replace(" ", "")
    neg = s.startswith("(") and s.endswith(")")
    s = s.strip("()")
    try:
        n = float(s)
    except ValueError:
        return None
    return -n if neg else n


def token_f1(pred: str, gold: str) -> float:
    p, g = normalize(pred).split(), normalize(gold).split()
    if not p and not g:
        return 1.0
    common = sum((Counter(p) & Counter(g)).values())
    if not common:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def score_field(kind: str, pred: Any, gold: Any, *, rel_tol: float = 0.0, pred_scale: str | None = None,
                gold_scale: str | None = None, gold_type: str | None = None) -> dict[str, float] | None:
    if gold is None:
        return None
    if pred is None:
        return {"score": 0.0, **({"em": 0.0, "f1": 0.0} if kind == "tatqa" else {})}
    if kind == "exact":
        return {"score": float(_text(pred) == _text(gold))}
    if kind == "numeric":
        p, g = to_number(pred), to_number(gold)
        if p is None or g is None:
            return {"score": 0.0}
        return {"score": float(abs(p - g) <= max(rel_tol * abs(g), 1e-9))}
    if kind == "f1":
        return {"score": token_f1(_text(pred), _text(gold))}
    if kind == "set":
        p, g = set(map(normalize, _items(pred))), set(map(normalize, _items(gold)))
        union = p | g
        return {"score": float(p == g), "jaccard": len(p & g) / len(union) if union else 1.0}
    if kind == "tatqa":
        em, f1 = tatqa(pred, gold, pred_scale or "", gold_scale or "", gold_type)
        return {"score": em, "em": em, "f1": f1}
    raise ValueError(f"unknown score {kind!r}")


def tatqa(pred: Any, gold: Any, pred_scale: str, gold_scale: str, gold_type: str | None) -> tuple[float, float]:
    """Exact match and F1 of one answer, as TAT-QA's evaluation computes them."""
    preds = _items(pred)
    golds = _items(gold)
    if not preds or not golds:
        return 0.0, 0.0
    pred_strings = [_answer_string(preds, pred_scale)]
    if len(preds) == 1 and not pred_scale and "%" not in str(preds[0]) and to_number(preds[0]) is not None:
        pred_strings.append("%.4f" % to_number(preds[0]))  # 0.2342 may mean 23.42 percent
    gold_string = _answer_string(golds, gold_scale)
    # The best (exact match, F1) pair over the prediction's readings, compared as pairs.
    em, f1 = max((float(normalize(p) == normalize(gold_string)), round(_bag_f1(p, gold_string), 2))
                 for p in pred_strings)
    if gold_type in ("arithmetic", "count"):
        f1 = em
    return em, f1


def _answer_string(answers: list[Any], scale: str) -> str:
    """The answers sorted and written out, numbers with their scale applied, as one string."""
    out = []
    for a in sorted(map(str, answers)):
        n = to_number(a)
        if n is None:
            out.append(f"{a} {scale}" if scale else a)
        elif "%" in a:  # "12%" is 0.12, as 12 with the scale percent
            out.append("%.4f" % round(n / 100, 4))
        else:
            out.append("%.4f" % (round(n, 2) * SCALES.get(scale, 1.0)))
    return " ".join(out)


def _bag_f1(pred: str, gold: str) -> float:
    p, g = set(normalize(pred).split()), set(normalize(gold).split())
    inter = len(p & g)
    precision = inter / len(p) if p else 1.0
    recall = inter / len(g) if g else 1.0
    return 0.0 if precision == 0 and recall == 0 else 2 * precision * recall / (precision + recall)


def _items(v: Any) -> list[Any]:
    if v is None:
        return []
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _text(v: Any) -> str:
    return normalize(" ".join(map(str, v)) if isinstance(v, (list, tuple)) else v)
