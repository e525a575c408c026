"""``slack-agent soak``: replicas (``replicas``) under what Slack sends a busy workspace
(``load``) and under faults, then every promise checked (``run``); with ``--profile``, where
the time went (``probe`` inside each replica, ``profile`` for the summary)."""
