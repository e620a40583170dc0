"""The simulated worker pool: an OpenAI-compatible HTTP server on loopback that
answers the questions of known query sets, right with a configured probability
per worker and task, and structured requests (a JSON Schema) with a record
whose fields take their references with that probability (see `structured`),
with configurable latency and faults (rate limits, errors, hangs, dropped
connections, malformed JSON, API-key checks). litellm reaches it through its
ordinary OpenAI-compatible path (model "openai/<name>", api_base "<url>/v1").

Start it with `conductor sim` or, from Python, `start_sim(...)`.
"""

from conductor.sim.process import SimHandle, start_sim

__all__ = ["SimHandle", "start_sim"]
