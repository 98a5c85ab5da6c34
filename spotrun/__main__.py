"""``python -m spotrun``: the command line (the same as the ``spotrun`` script)."""

import sys

from spotrun.orchestrator.cli.main import main

sys.exit(main())
