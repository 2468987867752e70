"""The benchmark scripts import their helpers as top-level modules (``common``,
``mixing_analysis``), as they do when run as ``python bench/<script>.py``."""

import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parents[2] / "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
