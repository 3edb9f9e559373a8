"""`jaxdecode bench`: the decode benchmark harness, its GPU suite, the HF peers and the report.

- `timing`: one timed run of one engine (`time_engine`), the `Timing` every system fills, the cache
  length and chunking rules, the read ceiling, the token agreement.
- `suite`: the plan and run of the suite, ours against plain-JAX and HF peers, as JSON lines.
- `peers`: HF transformers eager and static cache + torch.compile on a copy of our weights; it needs
  torch and transformers (the extra `jaxdecode[peers]`) and is imported only when a peer is asked for.
- `report`: the line per row, the summary object and the plot.
- `command`: the `jaxdecode bench` flags made into a plan, or the plain timing of one engine.
- `startup`: seconds to the first visible output and the first token of the quick-start command, run on
  pseudo-terminals (`python -m jaxdecode.bench.startup`).
"""

from jaxdecode.bench.command import run_cli_bench
from jaxdecode.bench.suite import HF_PEERS, PEERS, SUITES, SuitePlan, load_peers, run_suite
from jaxdecode.bench.timing import (
    Timing,
    cache_length,
    chunking,
    compiled_steps,
    loop_mode,
    read_ceiling_gb_s,
    time_engine,
    tokens_agree,
)

__all__ = [
    "HF_PEERS",
    "PEERS",
    "SUITES",
    "SuitePlan",
    "Timing",
    "cache_length",
    "chunking",
    "compiled_steps",
    "load_peers",
    "loop_mode",
    "read_ceiling_gb_s",
    "run_cli_bench",
    "run_suite",
    "time_engine",
    "tokens_agree",
]
