"""``python -m agentic_lora.cli``: the ``agentic-lora`` command."""

import sys

from agentic_lora.cli.main import main

sys.exit(main())
