"""Checkpoints shipped inside the package, addressed by name in `model.hf_path`.

`demo-base` is the demo policy after a long warm start on the demo domain's training split
(`configs/demo.py:base`, about 55 minutes on a 2-core CPU), stored in bfloat16 (~2 MB). A policy
trained from scratch learns the format of its messages within a few hundred steps but only
starts to copy ids and amounts from its context after ~1,500 steps; starting from this base
lets the default demo job fit its time budget. `demo-base-simulator` is that base continued
for 1,200 steps with the grounded rehearsal view's simulator rows
(`configs/demo.py:base_simulator`): it copies a logged tool response when one matches the
call, and its next action follows the status a lookup shows. It is the demo jobs' base;
`demo-base` remains a policy that makes tool calls for the tests. `make demo-base` rebuilds both.
"""

from __future__ import annotations

import os

DEMO_BASE = "demo-base"
DEMO_BASE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_base")
DEMO_BASE_SIMULATOR = "demo-base-simulator"
DEMO_BASE_SIMULATOR_DIR = os.path.join(os.path.dirname(DEMO_BASE_DIR), "demo_base_simulator")
SHIPPED = {DEMO_BASE: DEMO_BASE_DIR, DEMO_BASE_SIMULATOR: DEMO_BASE_SIMULATOR_DIR}


def resolve_hf_path(hf_path: str) -> str:
    """The directory `hf_path` names: a shipped checkpoint's name, or the path itself."""
    return SHIPPED.get(hf_path, hf_path)
