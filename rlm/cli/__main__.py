"""``python -m rlm.cli`` runs the rlm command, as ``python -m rlm`` does."""

import sys

from rlm.cli.commands import main

sys.exit(main())
