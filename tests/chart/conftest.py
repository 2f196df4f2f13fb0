"""Fixtures of the chart checks (defined in chartlib, a uniquely named module beside this file)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chartlib import helm, promtool, rendered, value_set  # noqa: E402,F401  (fixtures)
