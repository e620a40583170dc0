"""The budget ledger under concurrency: reservations never let spend pass a cap."""

import asyncio
import random

import pytest

from conductor.execute.budget import BudgetExhausted, Ledger


def test_many_concurrent_calls_never_exceed_the_cap():
    async def main():
        ledger = Ledger({"p": 1.0})
        rng = random.Random(1)
        paid, refused = [], 0

        async def call():
            nonlocal refused
            worst = 0.05
            try:
                r = await ledger.reserve("p", worst)
            except BudgetExhausted:
                refused += 1
                return
            await asyncio.sleep(rng.random() / 100)
            actual = worst * rng.uniform(0.2, 1.0)
            paid.append(actual)
            await ledger.settle(r, actual)

        await asyncio.gather(*(call() for _ in range(500)))
        return ledger, paid, refused

    ledger, paid, refused = asyncio.run(main())
    assert sum(paid) <= 1.0 + 1e-9
    assert refused > 0
    # Waiting for pending reservations to settle lets the budget be used nearly fully.
    assert sum(paid) > 1.0 - 0.05


def test_resume_counts_earlier_spend_and_run_cap():
    async def main():
        ledger = Ledger({"p": 10.0}, run_limit=1.0, spent={"p": 0.98})
        with pytest.raises(BudgetExhausted, match="run cap"):
            await ledger.reserve("p", 0.05)
        r = await ledger.reserve("p", 0.01)
        await ledger.settle(r, 0.01)
        return ledger.summary()

    summary = asyncio.run(main())
    assert summary[-1]["spent_usd"] == pytest.approx(0.99)
