"""The committed trained fixture every test that needs real MTP weights reads, and its dimensions.

Read from the fixture's own config.json so a rebuilt fixture (other depth or width) needs no test edits.
"""

from __future__ import annotations

import json
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "deepseek_v3_mtp"
CONFIG = json.loads((FIXTURE / "config.json").read_text())
H = CONFIG["hidden_size"]  # hidden size
L = CONFIG["num_hidden_layers"]  # trunk depth: the MTP modules sit at model.layers.{L} and {L + 1}

# The second trained family (GLM-4.5's layout: GQA attention, one MTP module at model.layers.{L}).
GLM_FIXTURE = FIXTURE.parent / "glm4_moe_mtp"
# Every trained sequential-MTP fixture, for the tests parametrized over families.
TRAINED = {"deepseek_v3": FIXTURE, "glm4_moe": GLM_FIXTURE}
