"""``python -m rlm`` runs the rlm command."""

import sys

from rlm.cli import main

sys.exit(main())
