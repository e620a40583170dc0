"""`conductor sim`: run the simulated worker pool in the foreground."""

from __future__ import annotations

from conductor.sim.main import add_arguments, run


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "sim", help="serve a simulated worker pool (OpenAI-compatible HTTP on loopback)",
        description="Serve every openai/<name> llm worker of a pool as a simulated model that answers "
                    "the questions of the given query sets, with the pool's simulate: settings.")
    add_arguments(p)
    p.set_defaults(func=run)
