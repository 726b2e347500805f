"""`python -m moeheal` is `moeheal`."""

import sys

from moeheal.pipeline.cli import main

sys.exit(main())
