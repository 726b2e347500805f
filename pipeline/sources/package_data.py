"""Where the package data lives: `moeheal/data` (the bundled corpus, the demo vocabulary).

Beside `moeheal/__init__.py` both in a checkout and installed; found through the
import system rather than this file's path, whose folder differs between the
two (`pipeline/` in a checkout, `moeheal/pipeline/` installed).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

DATA = Path(str(files("moeheal") / "data"))
