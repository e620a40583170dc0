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


def test_a_call_that_fits_once_all_else_settled_is_not_kept_waiting_by_float_residue():
    """Settled amounts can leave a float residue in `reserved` (a few 1e-12 with batch-sized
    reservations of thousands of dollars); a call that fits only without it used to wait
    forever for a settle that would never come."""
    async def main():
        ledger = Ledger({"p": 30000.0})
        held = [await ledger.reserve("p", amount) for amount in (8641.9746, 0.7, 13580.2458)]
        for r in (held[2], held[0], held[1]):
            await ledger.settle(r, 0.0)
        # nothing is pending: the call is reserved at once (the timeout only guards a hang)
        r = await asyncio.wait_for(ledger.reserve("p", 30000.0), 30)
        return r.amount

    assert asyncio.run(main()) == 30000.0


def test_a_call_larger_than_the_whole_cap_says_the_cap_is_too_small():
    """`run cap $0.0030, spent $0.0000, this call needs up to $0.0084` read as a bug: no spend
    could ever have made room (audit47)."""
    async def main():
        ledger = Ledger({"p": None}, run_limit=0.003)
        with pytest.raises(BudgetExhausted) as e:
            await ledger.reserve("p", 0.0084)
        return str(e.value)

    said = asyncio.run(main())
    assert said == ("budget too small: run cap $0.003 is below this call's worst case $0.0084 (prompt bytes + "
                    "max_tokens); raise the cap or lower max_tokens")
