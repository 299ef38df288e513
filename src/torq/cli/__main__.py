"""``python -m torq.cli``: the ``torq`` command."""

import sys

from torq.cli import main

sys.exit(main())
