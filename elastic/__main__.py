"""``python -m elastic``: the same as the ``elastic`` console script."""

import sys

from elastic.launch.cli import main

sys.exit(main())
