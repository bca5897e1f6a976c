"""``python -m cli ...`` is ``kvgate ...`` (tests start the gateway this way)."""

import sys

from cli.main import main

sys.exit(main())
