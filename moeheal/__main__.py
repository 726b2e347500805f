"""`python -m moeheal` is `moeheal`."""

import sys
from pathlib import Path

# `python -m` puts the working directory first on sys.path. In a checkout's root that exposes the
# top-level folders (`kernels/`, `pipeline/`, ...) ahead of installed distributions of the same names
# (transformers imports Hugging Face's `kernels`); the package itself is already imported, and its
# subpackages come from the install's own mapping, so the entry is dropped.
_CHECKOUT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == _CHECKOUT and (_CHECKOUT / "pyproject.toml").is_file():
    del sys.path[0]

from moeheal.pipeline.commands.cli import main  # noqa: E402

sys.exit(main())
