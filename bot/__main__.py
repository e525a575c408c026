"""``python -m bot``: the same command as ``slack-agent``."""

import sys

from slack_agent.cli import main

sys.exit(main())
