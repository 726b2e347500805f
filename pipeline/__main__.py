"""`python -m pipeline` is `moeheal`."""

import sys

from pipeline.cli import main

sys.exit(main())
