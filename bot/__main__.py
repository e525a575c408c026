"""``python -m bot``: the same command as ``slack-agent``."""

import sys

from bot.cli import main

sys.exit(main())
