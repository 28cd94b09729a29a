"""`python -m delaywheel_shop demo | sweep | customers | migrate` (delaywheel_shop.cli)."""

import sys

from delaywheel_shop.cli import main

sys.exit(main())
