"""The simulated worker pool: an OpenAI-compatible HTTP server on loopback that
answers the questions of known query sets, right with a configured probability
per worker and task, and structured requests (a JSON Schema) with a record
whose fields take their references with that probability (see `structured`),
with configurable latency and faults (rate limits, errors, hangs, dropped
connections, malformed JSON, API-key checks). litellm reaches it through its
ordinary OpenAI-compatible path (model "openai/<name>", api_base "<url>/v1").

Start it with `conductor sim` or, from Python, `start_sim(...)`.
"""

__all__ = ["SimHandle", "start_sim"]


def __getattr__(name: str):
    # Loaded on first use: the command line reads this package's options without the web server.
    if name in __all__:
        import importlib

        return getattr(importlib.import_module("conductor.sim.process"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
