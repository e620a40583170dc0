"""The project's sample query sets, generated from a seed rather than collected.

Every reference is computed by this module (or read from a small table typed
into it), so the sets carry no licensing question, can be regenerated exactly
from the seed, and their references can be checked by recomputation.

`generate(out_dir, seed)` writes five zstd Parquet files with the columns of
`conductor.queries.SCHEMA`: arithmetic, choice, factual and finance, plus
`sample.parquet`, the demo set that mixes the other four. A row in the sample
keeps the id it has in its own set: it is the same query.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from conductor.queries import SCHEMA

Row = dict[str, str]
# A template draws one question from the generator: (prompt, reference, kind).
Template = Callable[[random.Random], tuple[str, str, str]]

SIZES = {"arithmetic": 120, "choice": 100, "factual": 100, "finance": 80}
SAMPLE_SIZE = 400
_ID_PREFIX = {"arithmetic": "arith", "choice": "choice", "factual": "fact", "finance": "fin"}
_TASK = {"arithmetic": "math", "choice": "choice", "factual": "exact", "finance": "math"}
_MAX_TRIES = 1000


def generate(out_dir: Path, seed: int = 7) -> dict[str, Path]:
    """Write every set into `out_dir`; returns set name -> file path.

    Each set has its own generator derived from the seed, so changing the size
    or a template of one set leaves the others untouched.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    builders = {"arithmetic": arithmetic_rows, "choice": choice_rows,
                "factual": factual_rows, "finance": finance_rows}
    sets = {name: build(random.Random(f"{seed}:{name}"), SIZES[name])
            for name, build in builders.items()}
    sets["sample"] = sample_rows(sets, random.Random(f"{seed}:sample"), SAMPLE_SIZE)
    paths = {}
    for name, rows in sets.items():
        paths[name] = out_dir / f"{name}.parquet"
        _write(rows, paths[name])
    return paths


def _write(rows: list[Row], path: Path) -> None:
    table = pa.table({c: pa.array([r[c] for r in rows], pa.string()) for c in SCHEMA.names}, schema=SCHEMA)
    pq.write_table(table, path, compression="zstd")


def _rows_from(name: str, templates: list[Template], rng: random.Random, n: int) -> list[Row]:
    """Cycle through the templates so each set covers all of them evenly;
    a prompt drawn twice is drawn again, so no set holds duplicates."""
    rows, seen = [], set()
    for i in range(n):
        template = templates[i % len(templates)]
        for _ in range(_MAX_TRIES):
            prompt, reference, kind = template(rng)
            if prompt not in seen:
                break
        else:
            raise RuntimeError(f"template {template.__name__} keeps repeating itself")
        seen.add(prompt)
        rows.append(_row(name, i, prompt, reference, {"set": name, "kind": kind}))
    return rows


def _row(name: str, i: int, prompt: str, reference: str, meta: dict) -> Row:
    return {"query_id": f"{_ID_PREFIX[name]}-{i + 1:04d}", "prompt": prompt, "task": _TASK[name],
            "reference": reference, "metadata": json.dumps(meta, sort_keys=True, ensure_ascii=False)}


def sample_rows(sets: dict[str, list[Row]], rng: random.Random, size: int) -> list[Row]:
    """The demo set: every row when the sets are small enough, else an even
    share of each set; shuffled so that a demo run on its first rows still
    sees every task."""
    if sum(len(rows) for rows in sets.values()) <= size:
        picked = [row for rows in sets.values() for row in rows]
    else:
        share = max(1, size // len(sets))
        picked = [row for rows in sets.values() for row in rng.sample(rows, min(share, len(rows)))]
    rng.shuffle(picked)
    return picked


# --- numbers -----------------------------------------------------------------

def round_half_up(x: Fraction, places: int) -> str:
    """`x` rounded to `places` decimals (halves away from zero), as a plain string."""
    scaled = abs(x) * 10**places
    n = math.floor(scaled + Fraction(1, 2))
    sign = "-" if x < 0 and n else ""
    if places == 0:
        return f"{sign}{n}"
    return f"{sign}{n // 10**places}.{n % 10**places:0{places}d}"


def near_tie(x: Fraction, places: int) -> bool:
    """True when `x` sits so close to a rounding boundary that a solver who
    rounds an intermediate step could honestly land on the other side."""
    frac = (abs(x) * 10**places) % 1
    return abs(frac - Fraction(1, 2)) < Fraction(1, 50)


def _money(n: int) -> str:
    return f"${n:,}"


# --- arithmetic word problems -------------------------------------------------

_NAMES = ["Maya", "Leo", "Priya", "Tomas", "Aisha", "Ben", "Chen", "Dana", "Elif", "Farid",
          "Grace", "Hugo", "Ines", "Jonah", "Keiko", "Luis", "Mira", "Nikolai", "Olga", "Pablo"]
_ITEMS = [("notebooks", 2, 6), ("pens", 1, 4), ("mugs", 5, 12), ("T-shirts", 8, 20), ("candles", 3, 9),
          ("puzzles", 7, 18), ("plant pots", 4, 11), ("sketchbooks", 6, 15)]
_MULTIPLE = {2: "twice", 3: "three times", 4: "four times", 5: "five times"}


def _two_names(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(_NAMES, 2)
    return a, b


def shopping(rng: random.Random) -> tuple[str, str, str]:
    """Change from a bill: two products, one subtraction."""
    name = rng.choice(_NAMES)
    (p1, lo1, hi1), (p2, lo2, hi2) = rng.sample(_ITEMS, 2)
    q1, q2 = rng.randint(2, 6), rng.randint(2, 5)
    c1, c2 = rng.randint(lo1, hi1), rng.randint(lo2, hi2)
    total = q1 * c1 + q2 * c2
    bill = next(b for b in (20, 50, 100, 200) if b > total)
    prompt = (f"{name} buys {q1} {p1} at ${c1} each and {q2} {p2} at ${c2} each, "
              f"and pays with a ${bill} bill. How much change, in dollars, does {name} receive?")
    return prompt, str(bill - total), "shopping"


def average_speed(rng: random.Random) -> tuple[str, str, str]:
    """Two legs at different speeds; the average is total distance over total time."""
    while True:
        h1, h2 = rng.randint(1, 4), rng.randint(1, 4)
        v1, v2 = rng.randrange(40, 121, 5), rng.randrange(40, 121, 5)
        if v1 != v2 and (h1 * v1 + h2 * v2) % (h1 + h2) == 0:
            break
    vehicle = rng.choice(["A train", "A bus", "A delivery van", "A car"])
    hours = lambda h: f"{h} hour" + ("s" if h > 1 else "")  # noqa: E731
    prompt = (f"{vehicle} travels for {hours(h1)} at {v1} km/h and then for {hours(h2)} at {v2} km/h. "
              f"What is its average speed over the whole journey, in km/h?")
    return prompt, str((h1 * v1 + h2 * v2) // (h1 + h2)), "average_speed"


def _clock(minutes: int) -> str:
    h, m = divmod(minutes, 60)
    suffix = "a.m." if h < 12 else "p.m."
    return f"{(h - 1) % 12 + 1}:{m:02d} {suffix}"


def shift_length(rng: random.Random) -> tuple[str, str, str]:
    """Clock arithmetic across noon, minus an unpaid break."""
    start = rng.randint(6 * 12, 9 * 12 + 11) * 5
    end = rng.randint(15 * 12, 18 * 12 + 11) * 5
    pause = rng.choice([15, 20, 30, 45, 60])
    name = rng.choice(_NAMES)
    prompt = (f"{name} starts work at {_clock(start)} and finishes at {_clock(end)} the same day, "
              f"taking one unpaid break of {pause} minutes. How many minutes of paid work is that?")
    return prompt, str(end - start - pause), "time"


def ages(rng: random.Random) -> tuple[str, str, str]:
    """Built backwards from the child's age so every age is a plausible whole number."""
    while True:
        child, now, later = rng.randint(4, 16), rng.randint(3, 5), rng.randint(2, 4)
        if later >= now or not (24 <= now * child <= 60 and (now - 1) * child >= 18):
            continue
        years, rest = divmod(child * (now - later), later - 1)
        if rest == 0 and 2 <= years <= 30:
            break
    parent, pronoun, possessive = rng.choice([("mother", "she", "her"), ("father", "he", "his")])
    kid = rng.choice(["son", "daughter"])
    prompt = (f"Today a {parent} is {_MULTIPLE[now]} as old as {possessive} {kid}. "
              f"In {years} years, {pronoun} will be {_MULTIPLE[later]} as old as the {kid} will be then. "
              f"How old is the {parent} today, in years?")
    return prompt, str(now * child), "ages"


def fractions_left(rng: random.Random) -> tuple[str, str, str]:
    """Two successive fractions, the second of the remainder (a classic slip)."""
    f1 = Fraction(rng.randint(1, 3), rng.choice([4, 5, 6, 8]))
    f2 = Fraction(1, rng.choice([2, 3, 4]))
    total = f1.denominator * f2.denominator * rng.randint(3, 15)
    left = (total - total * f1) * (1 - f2)
    name = rng.choice(_NAMES)
    thing, unit = rng.choice([("apples", "apples"), ("strawberries", "strawberries"), ("potatoes", "kilograms of potatoes")])
    prompt = (f"{name} harvests {total} {unit}, sells {f1.numerator}/{f1.denominator} of them at the market "
              f"and gives {f2.numerator}/{f2.denominator} of the remaining {thing} to neighbours. "
              f"How many {unit} does {name} keep?")
    return prompt, str(int(left)), "fractions"


def discount_tax(rng: random.Random) -> tuple[str, str, str]:
    """Percent off, then tax on the discounted price; the question names the rounding."""
    while True:
        price = rng.randint(12, 240)
        off, tax = rng.choice([10, 15, 20, 25, 30, 40]), rng.choice([5, 6, 7, 8, 9, 10])
        final = Fraction(price) * (100 - off) / 100 * (100 + tax) / 100
        if not near_tie(final, 2):
            break
    item = rng.choice(["jacket", "lamp", "pair of boots", "backpack", "bicycle helmet", "coffee grinder"])
    prompt = (f"A {item} is priced at ${price}. The shop takes {off}% off, then adds {tax}% sales tax "
              f"to the discounted price. What does the customer pay, in dollars? "
              f"Give the answer rounded to two decimal places.")
    return prompt, round_half_up(final, 2), "percent"


def work_rate(rng: random.Random) -> tuple[str, str, str]:
    """Rates add, times do not."""
    while True:
        a, b = rng.sample(range(2, 13), 2)
        if (60 * a * b) % (a + b) == 0:
            break
    prompt = (f"Pipe A alone fills an empty tank in {a} hours; pipe B alone fills it in {b} hours. "
              f"With both pipes open, how many minutes does it take to fill the empty tank?")
    return prompt, str(60 * a * b // (a + b)), "rates"


def score_needed(rng: random.Random) -> tuple[str, str, str]:
    """The missing term for a target mean."""
    while True:
        scores = [rng.randint(60, 98) for _ in range(4)]
        target = rng.randint(75, 90)
        needed = 5 * target - sum(scores)
        if 50 <= needed <= 100:
            break
    name = rng.choice(_NAMES)
    prompt = (f"{name} scored {scores[0]}, {scores[1]}, {scores[2]} and {scores[3]} points on four tests. "
              f"What score on the fifth test would make {name}'s average over all five tests exactly {target}?")
    return prompt, str(needed), "average"


def savings_catch_up(rng: random.Random) -> tuple[str, str, str]:
    """Built from the answer: pick the week, derive the head start."""
    weeks = rng.randint(3, 20)
    slow, fast = sorted(rng.sample(range(5, 40, 5), 2))
    behind = rng.randrange(10, 200, 10)
    ahead = behind + weeks * (fast - slow)
    a, b = _two_names(rng)
    prompt = (f"{a} has ${ahead} saved and adds ${slow} every week. {b} has ${behind} saved and adds "
              f"${fast} every week. After how many weeks will they have the same amount saved?")
    return prompt, str(weeks), "catch_up"


def simple_interest(rng: random.Random) -> tuple[str, str, str]:
    """Interest on the principal only, then a withdrawal."""
    principal = rng.randrange(1000, 10001, 100)
    rate, years = rng.randint(2, 7), rng.randint(2, 6)
    balance = principal + principal * rate * years // 100
    withdrawal = rng.randrange(100, principal // 2, 50)
    name = rng.choice(_NAMES)
    prompt = (f"{name} deposits {_money(principal)} in an account paying {rate}% simple interest per year. "
              f"After {years} years {name} withdraws {_money(withdrawal)}. "
              f"How many dollars remain in the account?")
    return prompt, str(balance - withdrawal), "interest"


def ratio_split(rng: random.Random) -> tuple[str, str, str]:
    """Shares in a ratio, then a difference between two of them."""
    parts = sorted(rng.sample(range(1, 10), 3))
    unit = rng.randint(5, 60)
    order = parts[:]
    rng.shuffle(order)
    total = sum(order) * unit
    a, b, c = rng.sample(_NAMES, 3)
    prompt = (f"{a}, {b} and {c} share ${total} in the ratio {order[0]}:{order[1]}:{order[2]}, in that order. "
              f"How many dollars more than the smallest share is the largest share?")
    return prompt, str((parts[2] - parts[0]) * unit), "ratio"


def warehouse(rng: random.Random) -> tuple[str, str, str]:
    """A running total over several days with a multiple and a product."""
    monday = rng.randint(40, 150)
    pallets, per = rng.randint(2, 6), rng.choice([12, 20, 24, 30, 40])
    factor = rng.choice([2, 3])
    start = rng.randint(factor * monday + monday, 900)
    left = start - monday + pallets * per - factor * monday
    prompt = (f"A warehouse starts the week with {start} boxes. On Monday it ships {monday} boxes. "
              f"On Tuesday it receives {pallets} pallets of {per} boxes each. On Wednesday it ships "
              f"{_MULTIPLE[factor]} as many boxes as it shipped on Monday. "
              f"How many boxes are in the warehouse at the end of Wednesday?")
    return prompt, str(left), "inventory"


def recipe(rng: random.Random) -> tuple[str, str, str]:
    """Scaling through the amount per person."""
    serves = rng.choice([2, 3, 4, 6, 8])
    per_person = rng.choice([25, 30, 40, 50, 60, 75, 80, 90])
    guests = rng.randint(5, 30)
    if guests == serves:
        guests += 1
    ingredient = rng.choice(["flour", "rice", "sugar", "pasta", "oats"])
    prompt = (f"A recipe that serves {serves} people uses {serves * per_person} grams of {ingredient}. "
              f"How many grams of {ingredient} are needed to serve {guests} people?")
    return prompt, str(per_person * guests), "recipe"


def population(rng: random.Random) -> tuple[str, str, str]:
    """Successive percentage changes compound; they do not add."""
    while True:
        start = rng.randrange(1000, 50001, 100)
        up, down = rng.choice([5, 10, 12, 15, 20, 25]), rng.choice([4, 5, 8, 10, 20])
        end = Fraction(start) * (100 + up) / 100 * (100 - down) / 100
        if end.denominator == 1:
            break
    prompt = (f"A town had {start:,} residents. Its population grew by {up}% during one year and then "
              f"fell by {down}% during the next year. How many residents did it have at the end?")
    return prompt, str(int(end)), "percent_change"


ARITHMETIC: list[Template] = [shopping, average_speed, shift_length, ages, fractions_left, discount_tax,
                              work_rate, score_needed, savings_catch_up, simple_interest, ratio_split,
                              warehouse, recipe, population]


def arithmetic_rows(rng: random.Random, n: int) -> list[Row]:
    return _rows_from("arithmetic", ARITHMETIC, rng, n)


# --- multiple choice ------------------------------------------------------------

LETTERS = "ABCDE"
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def _options(rng: random.Random, answer: str, distractors: list[str]) -> tuple[str, str]:
    """Shuffle the answer among 3 or 4 distinct distractors; returns (block, letter)."""
    pool = sorted({d for d in distractors if d != answer})
    chosen = rng.sample(pool, rng.choice([3, 4]) if len(pool) >= 4 else 3)
    options = [answer] + chosen
    rng.shuffle(options)
    block = "Options:\n" + "\n".join(f"{LETTERS[i]}) {o}" for i, o in enumerate(options))
    return block, LETTERS[options.index(answer)]


def _choice(rng: random.Random, question: str, answer: str, distractors: list[str], kind: str):
    block, letter = _options(rng, answer, distractors)
    return f"{question}\n\n{block}\n\nAnswer with the letter of the correct option.", letter, kind


def _near(answer: int, steps: list[int]) -> list[str]:
    return [str(answer + s) for s in steps if answer + s > 0]


def product_choice(rng: random.Random):
    """Distractors are the usual slips: off by one factor, a carry, a digit."""
    a, b = rng.randint(12, 99), rng.randint(12, 99)
    ans = a * b
    return _choice(rng, f"What is {a} × {b}?", str(ans), _near(ans, [a, -a, b, -b, 10, -10, 100, -100]), "product")


_CONVERSIONS = [("kilometres", "metres", 1000), ("kilograms", "grams", 1000), ("hours", "minutes", 60),
                ("days", "hours", 24), ("feet", "inches", 12), ("yards", "feet", 3),
                ("litres", "millilitres", 1000), ("minutes", "seconds", 60), ("weeks", "days", 7),
                ("metres", "centimetres", 100)]


def conversion_choice(rng: random.Random):
    """Exact conversions only; distractors use a wrong factor or a misplaced zero."""
    big, small, factor = rng.choice(_CONVERSIONS)
    value = rng.randint(2, 48)
    ans = value * factor
    wrong = {value * f for _, _, f in _CONVERSIONS if f != factor} | {ans * 10, ans // 10, ans + factor, ans - factor}
    return _choice(rng, f"How many {small} are in {value} {big}?", str(ans),
                   [str(w) for w in wrong if w > 0], "unit_conversion")


def is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))


def prime_choice(rng: random.Random):
    """Odd composites that are not multiples of 3 or 5, so no quick test gives it away."""
    primes = [n for n in range(30, 250) if is_prime(n)]
    composites = [n for n in range(30, 250) if not is_prime(n) and n % 2 and n % 3 and n % 5]
    return _choice(rng, "Which of the following numbers is prime?", str(rng.choice(primes)),
                   [str(c) for c in rng.sample(composites, 6)], "prime")


def fraction_choice(rng: random.Random):
    """Distinct values, so the largest is unique."""
    values: dict[Fraction, str] = {}
    while len(values) < 6:
        q = rng.randint(3, 12)
        f = Fraction(rng.randint(1, q - 1), q)
        values.setdefault(f, f"{f.numerator}/{f.denominator}")
    ranked = sorted(values)
    return _choice(rng, "Which of these fractions is the largest?", values[ranked[-1]],
                   [values[f] for f in ranked[:-1]], "largest_fraction")


def weekday_choice(rng: random.Random):
    """Day counts well past a week, so the answer needs a remainder."""
    start, n = rng.randrange(7), rng.randint(9, 400)
    return _choice(rng, f"If today is {DAYS[start]}, what day of the week will it be {n} days from today?",
                   DAYS[(start + n) % 7], DAYS, "day_of_week")


def lcm_choice(rng: random.Random):
    """Numbers that share a factor, so the product is a tempting wrong answer."""
    while True:
        g = rng.randint(2, 9)
        a, b = g * rng.randint(2, 9), g * rng.randint(2, 9)
        if a != b and math.gcd(a, b) > 1 and a % b and b % a:
            break
    ans = math.lcm(a, b)
    wrong = {a * b, math.gcd(a, b), ans * 2, ans + max(a, b), ans - min(a, b)}
    return _choice(rng, f"What is the least common multiple of {a} and {b}?", str(ans),
                   [str(w) for w in wrong if w > 0], "lcm")


def percent_choice(rng: random.Random):
    """Whole-number answers; distractors misplace the decimal or use the complement."""
    while True:
        p, base = rng.choice([5, 12, 15, 20, 25, 35, 40, 60, 75]), rng.randrange(40, 1001, 20)
        if p * base % 100 == 0:
            break
    ans = p * base // 100
    wrong = {ans * 10, base - ans, ans + p, ans + 10, ans - 5, base * p // 10}
    return _choice(rng, f"What is {p}% of {base}?", str(ans), [str(w) for w in wrong if w > 0], "percent_of")


CHOICE: list[Template] = [product_choice, conversion_choice, prime_choice, fraction_choice,
                          weekday_choice, lcm_choice, percent_choice]


def choice_rows(rng: random.Random, n: int) -> list[Row]:
    return _rows_from("choice", CHOICE, rng, n)


# --- short factual answers ------------------------------------------------------

# Picked for answers with one accepted spelling and no diacritics.
ELEMENTS = [("hydrogen", "H", 1), ("helium", "He", 2), ("lithium", "Li", 3), ("carbon", "C", 6),
            ("nitrogen", "N", 7), ("oxygen", "O", 8), ("fluorine", "F", 9), ("neon", "Ne", 10),
            ("sodium", "Na", 11), ("magnesium", "Mg", 12), ("silicon", "Si", 14), ("phosphorus", "P", 15),
            ("sulfur", "S", 16), ("chlorine", "Cl", 17), ("argon", "Ar", 18), ("potassium", "K", 19),
            ("calcium", "Ca", 20), ("iron", "Fe", 26), ("cobalt", "Co", 27), ("nickel", "Ni", 28),
            ("copper", "Cu", 29), ("zinc", "Zn", 30), ("silver", "Ag", 47), ("tin", "Sn", 50),
            ("iodine", "I", 53), ("gold", "Au", 79), ("mercury", "Hg", 80), ("lead", "Pb", 82),
            ("uranium", "U", 92)]
# Countries whose capital is neither disputed, split, nor moving.
CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Kenya", "Nairobi"), ("Peru", "Lima"),
            ("Argentina", "Buenos Aires"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
            ("Finland", "Helsinki"), ("Poland", "Warsaw"), ("Portugal", "Lisbon"), ("Greece", "Athens"),
            ("Ireland", "Dublin"), ("Austria", "Vienna"), ("Hungary", "Budapest"), ("Czechia", "Prague"),
            ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("South Korea", "Seoul"), ("Mexico", "Mexico City"),
            ("Chile", "Santiago"), ("Cuba", "Havana"), ("Morocco", "Rabat"), ("Ghana", "Accra"),
            ("Ethiopia", "Addis Ababa"), ("New Zealand", "Wellington"), ("Philippines", "Manila"),
            ("Iran", "Tehran"), ("Saudi Arabia", "Riyadh"), ("Pakistan", "Islamabad"), ("India", "New Delhi"),
            ("China", "Beijing"), ("Russia", "Moscow"), ("Germany", "Berlin"), ("Italy", "Rome"),
            ("Spain", "Madrid"), ("Denmark", "Copenhagen"), ("Belgium", "Brussels"), ("Romania", "Bucharest"),
            ("Australia", "Canberra"), ("Canada", "Ottawa"), ("Egypt", "Cairo"), ("Turkey", "Ankara")]
PLANETS = ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"]
BOOKS = [("Pride and Prejudice", "Jane Austen"), ("Nineteen Eighty-Four", "George Orwell"),
         ("Moby-Dick", "Herman Melville"), ("War and Peace", "Leo Tolstoy"),
         ("Anna Karenina", "Leo Tolstoy"), ("Don Quixote", "Miguel de Cervantes"),
         ("The Great Gatsby", "F. Scott Fitzgerald"), ("Hamlet", "William Shakespeare"),
         ("Crime and Punishment", "Fyodor Dostoevsky"), ("To Kill a Mockingbird", "Harper Lee"),
         ("Frankenstein", "Mary Shelley"), ("The Odyssey", "Homer"), ("Les Misérables", "Victor Hugo"),
         ("The Adventures of Tom Sawyer", "Mark Twain"), ("Brave New World", "Aldous Huxley"),
         ("Great Expectations", "Charles Dickens"), ("Madame Bovary", "Gustave Flaubert"),
         ("Ulysses", "James Joyce"), ("Dracula", "Bram Stoker"), ("Treasure Island", "Robert Louis Stevenson")]
_ORDINAL = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth"]


def factual_pool() -> list[tuple[str, str, str]]:
    """Every question the tables can answer, in a fixed order: (prompt, reference, kind)."""
    pool = []
    for name, symbol, number in ELEMENTS:
        pool.append((f"What is the chemical symbol of {name}? Answer with the symbol only.", symbol, "element_symbol"))
        pool.append((f"What is the atomic number of {name}? Answer with the number only.", str(number), "atomic_number"))
    for country, capital in CAPITALS:
        pool.append((f"What is the capital city of {country}? Answer with the city name only.", capital, "capital"))
    for i, planet in enumerate(PLANETS):
        pool.append((f"Counting outward from the Sun, which planet is the {_ORDINAL[i]}? "
                     f"Answer with the planet's name only.", planet, "planet_at_position"))
        pool.append((f"Counting outward from the Sun, what is the position of {planet} among the planets? "
                     f"Answer with a number only.", str(i + 1), "planet_position"))
    for title, author in BOOKS:
        pool.append((f"Who wrote \"{title}\"? Answer with the author's name only.", author, "author"))
    return pool


def factual_rows(rng: random.Random, n: int) -> list[Row]:
    picked = rng.sample(factual_pool(), n)
    return [_row("factual", i, p, r, {"set": "factual", "kind": k}) for i, (p, r, k) in enumerate(picked)]


# --- finance: ratios over generated statements -----------------------------------

_CO_FIRST = ["Northwind", "Bluefin", "Crescent", "Harbor", "Summit", "Ironwood", "Lakeshore", "Redpine",
             "Silverline", "Granite", "Meridian", "Oakridge", "Kestrel", "Brightwater", "Copperfield", "Tidewell"]
_CO_SECOND = ["Tools", "Foods", "Logistics", "Textiles", "Robotics", "Pharma", "Outdoor", "Software",
              "Furniture", "Packaging", "Optics", "Beverages"]
_CO_SUFFIX = ["Inc.", "Corp.", "Ltd.", "plc", "Group"]

IS_LINES = ["Revenue", "Cost of goods sold", "Operating expenses", "Interest expense",
            "Income tax expense", "Net income"]
BS_LINES = ["Cash and equivalents", "Accounts receivable", "Inventory", "Total current assets",
            "Property, plant and equipment, net", "Total assets", "Accounts payable", "Short-term debt",
            "Accrued liabilities", "Total current liabilities", "Long-term debt", "Total liabilities",
            "Shareholders' equity"]


def _pct(rng: random.Random, lo: int, hi: int, base: int) -> int:
    """`base` times a random percentage in [lo, hi], in whole currency units."""
    return base * rng.randint(lo * 100, hi * 100) // 10000


def income_statement(rng: random.Random, revenue: int) -> dict[str, int]:
    """One year whose lines add up: net income = revenue - COGS - opex - interest - tax."""
    while True:
        cogs = _pct(rng, 30, 80, revenue)
        opex = _pct(rng, 8, 35, revenue)
        interest = _pct(rng, 0, 3, revenue) + 1
        pretax = revenue - cogs - opex - interest
        if pretax > revenue // 50:
            break
    tax = _pct(rng, 12, 28, pretax)
    return dict(zip(IS_LINES, [revenue, cogs, opex, interest, tax, pretax - tax]))


def balance_sheet(rng: random.Random, revenue: int) -> dict[str, int]:
    """One year-end whose totals add up: assets = liabilities + equity > 0."""
    while True:
        cash, receivable, inventory = _pct(rng, 3, 20, revenue), _pct(rng, 5, 18, revenue), _pct(rng, 2, 20, revenue)
        ppe = _pct(rng, 20, 120, revenue)
        payable, short_debt, accrued = _pct(rng, 4, 15, revenue), _pct(rng, 1, 8, revenue), _pct(rng, 2, 8, revenue)
        long_debt = _pct(rng, 5, 60, revenue)
        current_assets = cash + receivable + inventory
        total_assets = current_assets + ppe
        current_liabilities = payable + short_debt + accrued
        liabilities = current_liabilities + long_debt
        if total_assets - liabilities > total_assets // 10:
            break
    return dict(zip(BS_LINES, [cash, receivable, inventory, current_assets, ppe, total_assets, payable, short_debt,
                               accrued, current_liabilities, long_debt, liabilities, total_assets - liabilities]))


def _markdown(title: str, years: list[int], data: dict[int, dict[str, int]], lines: list[str]) -> str:
    head = f"{title}\n\n| Line item | " + " | ".join(f"FY{y}" for y in years) + " |\n|---|" + "---:|" * len(years)
    body = "\n".join(f"| {line} | " + " | ".join(f"{data[y][line]:,}" for y in years) + " |" for line in lines)
    return f"{head}\n{body}"


def _plain(title: str, years: list[int], data: dict[int, dict[str, int]], lines: list[str]) -> str:
    parts = []
    for y in years:
        parts.append(f"Fiscal {y} {title.lower()}:\n" + "\n".join(f"- {line}: {data[y][line]:,}" for line in lines))
    return "\n\n".join(parts)


Lines = str | tuple[tuple[int, str], ...]


def _sum(figures: dict[str, int], lines: Lines) -> int:
    if isinstance(lines, str):
        return figures[lines]
    return sum(sign * figures[line] for sign, line in lines)


def _ratio(num: Lines, den: Lines) -> Callable[[dict, dict], Fraction]:
    """A ratio of (signed sums of) one year's lines; the prior year is not used."""
    return lambda cur, prev: Fraction(_sum(cur, num), _sum(cur, den))


_GROSS = ((1, "Revenue"), (-1, "Cost of goods sold"))
_OPERATING = _GROSS + ((-1, "Operating expenses"),)
_PRETAX = ((1, "Net income"), (1, "Income tax expense"))
_QUICK = ((1, "Total current assets"), (-1, "Inventory"))
_DEBT = ((1, "Short-term debt"), (1, "Long-term debt"))
_PERCENT = "Give the answer as a percentage rounded to one decimal place, without the % sign."
_TWO_PLACES = "Give the answer rounded to two decimal places."

@dataclass(frozen=True)
class Ratio:
    """One kind of finance question. The question states the formula, because
    "margin" or "debt" alone has several textbook definitions."""

    statements: str  # "is" (income statement), "bs" (balance sheet) or "both"
    places: int  # decimals the answer is rounded to
    percent: bool  # the ratio is asked for as a percentage
    question: str  # formatted with {year} and {prev}
    formula: Callable[[dict, dict], Fraction]  # (asked year's figures, prior year's) -> exact value


FINANCE_KINDS: dict[str, Ratio] = {
    "gross_margin": Ratio("is", 1, True, "What was the gross margin in fiscal {year}, defined as (revenue - cost of goods "
                     "sold) / revenue?", _ratio(_GROSS, "Revenue")),
    "operating_margin": Ratio("is", 1, True, "What was the operating margin in fiscal {year}, defined as (revenue - cost "
                         "of goods sold - operating expenses) / revenue?", _ratio(_OPERATING, "Revenue")),
    "net_margin": Ratio("is", 1, True, "What was the net margin in fiscal {year}, defined as net income / revenue?",
                   _ratio("Net income", "Revenue")),
    "revenue_growth": Ratio("is", 1, True, "By how much did revenue change from fiscal {prev} to fiscal {year}, as a "
                       "percentage of fiscal {prev} revenue (negative if revenue fell)?",
                       lambda cur, prev: Fraction(cur["Revenue"] - prev["Revenue"], prev["Revenue"])),
    "effective_tax_rate": Ratio("is", 1, True, "What was the effective tax rate in fiscal {year}, defined as income tax "
                           "expense / (net income + income tax expense)?", _ratio("Income tax expense", _PRETAX)),
    "interest_coverage": Ratio("is", 2, False, "What was the interest coverage ratio in fiscal {year}, defined as "
                          "(revenue - cost of goods sold - operating expenses) / interest expense?",
                          _ratio(_OPERATING, "Interest expense")),
    "current_ratio": Ratio("bs", 2, False, "What was the current ratio at the end of fiscal {year}, defined as total "
                      "current assets / total current liabilities?",
                      _ratio("Total current assets", "Total current liabilities")),
    "quick_ratio": Ratio("bs", 2, False, "What was the quick ratio at the end of fiscal {year}, defined as (total current "
                    "assets - inventory) / total current liabilities?", _ratio(_QUICK, "Total current liabilities")),
    "debt_to_equity": Ratio("bs", 2, False, "What was the debt-to-equity ratio at the end of fiscal {year}, defined as "
                       "(short-term debt + long-term debt) / shareholders' equity?",
                       _ratio(_DEBT, "Shareholders' equity")),
    "return_on_equity": Ratio("both", 1, True, "What was the return on equity in fiscal {year}, defined as net income / "
                         "shareholders' equity at the end of fiscal {year}?",
                         _ratio("Net income", "Shareholders' equity")),
}


def _company(rng: random.Random) -> str:
    return f"{rng.choice(_CO_FIRST)} {rng.choice(_CO_SECOND)} {rng.choice(_CO_SUFFIX)}"


def finance_question(rng: random.Random, kind: str) -> tuple[str, str, dict]:
    """One company, two fiscal years, one ratio; redrawn until the answer is not a near tie."""
    ratio = FINANCE_KINDS[kind]
    while True:
        company, first = _company(rng), rng.randint(2016, 2023)
        years = [first, first + 1]
        revenue0 = rng.randint(5_000, 900_000)
        revenues = [revenue0, revenue0 * rng.randint(80, 140) // 100]
        income = {y: income_statement(rng, r) for y, r in zip(years, revenues)}
        balance = {y: balance_sheet(rng, r) for y, r in zip(years, revenues)}
        year = years[1] if kind == "revenue_growth" else rng.choice(years)
        merged = {y: income[y] | balance[y] for y in years}
        value = ratio.formula(merged[year], merged[years[0]]) * (100 if ratio.percent else 1)
        if value != 0 and not near_tie(value, ratio.places) and abs(value) >= Fraction(1, 10):
            break
    shown = years if rng.random() < 0.5 else years[::-1]
    render = _markdown if rng.random() < 0.5 else _plain
    blocks = []
    if ratio.statements in ("is", "both"):
        blocks.append(render("Income statement", shown, income, IS_LINES))
    if ratio.statements in ("bs", "both"):
        blocks.append(render("Balance sheet at year end", shown, balance, BS_LINES))
    ask = ratio.question.format(year=year, prev=years[0]) + " " + (_PERCENT if ratio.percent else _TWO_PLACES)
    prompt = (f"The figures below are for {company}, in thousands of US dollars.\n\n" + "\n\n".join(blocks)
              + f"\n\nQuestion: {ask}")
    meta = {"set": "finance", "kind": kind, "company": company, "year": year}
    return prompt, round_half_up(value, ratio.places), meta


def finance_rows(rng: random.Random, n: int) -> list[Row]:
    kinds = list(FINANCE_KINDS)
    rows = []
    for i in range(n):
        prompt, reference, meta = finance_question(rng, kinds[i % len(kinds)])
        rows.append(_row("finance", i, prompt, reference, meta))
    return rows
