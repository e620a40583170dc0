"""Replay pools: workers that answer with real recorded model outputs.

The shared replay tables (../shared/replay) hold real responses of real models
to benchmark questions; users bring their own tables of the same shape, at any
path (`--table`), tasks mixed row by row, with recorded tokens and dollars if
they have them (a wide table, one column per model, converts with `convert`).
`conductor replay` turns one into a query set, a pool file (prices from a price
table or the recorded costs, a `replay:` block naming the table) and an
OpenAI-compatible server that answers exactly what was recorded and nothing
else. Plans over such a pool run through the ordinary executor, so cost, traces
and rewards come out as in any run.

Start the server with `conductor replay serve` or, from Python, `start_replay(...)`.
"""

__all__ = ["ReplayHandle", "start_replay"]


def __getattr__(name: str):
    # Loaded on first use: the command line reads this package's options without the web server.
    if name in __all__:
        import importlib

        return getattr(importlib.import_module("conductor.replay.process"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
