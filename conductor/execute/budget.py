"""USD budgets per provider and per run that hold under any concurrency.

Before a call is sent, its worst-case cost (prompt tokens x input price +
max_tokens x output price) is reserved against every cap it falls under; the
reservation becomes the real cost when the response arrives. A call that does
not fit waits while other reservations are pending (they usually settle for
less), and is refused only when it cannot fit even after they have settled.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any


class BudgetExhausted(Exception):
    def __init__(self, cap: str, limit: float, spent: float, need: float):
        if need > limit:  # "spent $0.0000" read as a bug when no spend could have made room
            why = (f"budget too small: {cap} cap ${limit:.6g} is below this call's worst case ${need:.6g} "
                   f"(prompt bytes + max_tokens); raise the cap or lower max_tokens")
        else:
            why = f"budget exhausted: {cap} cap ${limit:.4f}, spent ${spent:.4f}, this call needs up to ${need:.4f}"
        super().__init__(why)
        self.cap = cap
        self.limit = limit  # what is left (limit - spent) sizes the part of a batch that still fits
        self.spent = spent


@dataclass
class Cap:
    name: str
    limit: float | None
    spent: float = 0.0
    reserved: float = 0.0
    holds: int = 0  # reservations pending: exact, where `reserved` can keep a float residue

    def fits(self, amount: float) -> bool:
        return self.limit is None or self.spent + self.reserved + amount <= self.limit + 1e-12

    def could_fit(self, amount: float) -> bool:
        return self.limit is None or self.spent + amount <= self.limit + 1e-12


@dataclass
class Reservation:
    caps: list[Cap]
    amount: float
    settled: bool = field(default=False)


class Ledger:
    # The shared governor a SharedLedger keeps its caps on (conductor.execute.shared.governor); none here
    gov: Any = None

    def __init__(self, provider_limits: dict[str, float | None], run_limit: float | None = None,
                 spent: dict[str, float] | None = None):
        """`spent` carries what earlier attempts of the same run already paid (resume)."""
        spent = spent or {}
        self.run = Cap("run", run_limit, sum(spent.values()))
        self.providers = {p: Cap(f"provider {p}", lim, spent.get(p, 0.0)) for p, lim in provider_limits.items()}
        self._changed = asyncio.Condition()
        self.settles = 0  # reservations settled so far, for settled_since()

    async def reserve(self, provider: str, amount: float) -> Reservation:
        caps = [self.providers[provider], self.run]
        async with self._changed:
            while True:
                if all(c.fits(amount) for c in caps):
                    for c in caps:
                        c.reserved += amount
                        c.holds += 1
                    return Reservation(caps, amount)
                blocking = next(c for c in caps if not c.fits(amount))
                if not blocking.could_fit(amount) or blocking.holds == 0:
                    raise BudgetExhausted(blocking.name, blocking.limit or 0.0, blocking.spent, amount)
                await self._changed.wait()

    async def settle(self, r: Reservation, actual: float) -> None:
        """Turn a reservation into spend (0 for a call that never got an answer)."""
        if r.settled:
            return
        r.settled = True
        async with self._changed:
            for c in r.caps:
                c.holds -= 1
                c.reserved = c.reserved - r.amount if c.holds else 0.0
                c.spent += actual
            self.settles += 1
            self._changed.notify_all()

    def free(self, provider: str) -> float:
        """What can be reserved for the provider's calls now without waiting (a cap kept
        elsewhere, such as a shared governor's, is not seen here)."""
        caps = [self.providers[provider], self.run]
        return min((c.limit - c.spent - c.reserved for c in caps if c.limit is not None), default=math.inf)

    def pending(self, provider: str) -> bool:
        """Whether reservations on the provider's caps are pending: they may settle for less."""
        return any(c.holds for c in (self.providers[provider], self.run))

    def refusal(self, provider: str, amount: float) -> BudgetExhausted | None:
        """Why `amount` cannot be reserved even once the pending reservations settle (None: it could)."""
        for c in (self.providers[provider], self.run):
            if not c.could_fit(amount):
                return BudgetExhausted(c.name, c.limit or 0.0, c.spent, amount)
        return None

    async def settled_since(self, seen: int) -> None:
        """Return once a reservation has settled after `self.settles` was `seen`."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.settles != seen)

    def record(self, provider: str, amount: float) -> None:
        """Spend that needed no reservation (no budget in force)."""
        self.providers[provider].spent += amount
        self.run.spent += amount

    def outage_since(self) -> float | None:
        """When (time.monotonic()) the shared governor this ledger draws on stopped answering, for
        the calls it keeps back meanwhile (Executor.wait_for_governor); None while it answers, and
        always for a ledger in this process, which cannot be down."""
        return None if self.gov is None else self.gov.down_since

    def spent_by_provider(self) -> dict[str, float]:
        """What each provider's calls have cost so far, those of the spend given at the start included."""
        return {p: c.spent for p, c in self.providers.items()}

    def summary(self) -> list[dict]:
        return [{"cap": c.name, "limit_usd": c.limit, "spent_usd": round(c.spent, 6)}
                for c in [*self.providers.values(), self.run]]
