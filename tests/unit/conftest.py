"""tests/unit's helpers (graph_cycles) import as plain modules."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
