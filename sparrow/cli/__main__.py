"""`python -m sparrow.cli`: the same as the `sparrow` command."""

import sys

from sparrow.cli import main

sys.exit(main())
