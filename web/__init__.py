"""The web surface: the HTTP API under ``/v1`` (``web.api``), its sign-in, and the page.

Like every surface it reaches the core through ``core.conversation``, ``core.errors`` and
``core.runtime`` only; it never imports ``bot`` (what it needs of Slack, the channels a person
belongs to, the composition hands it: ``web.auth.Channels``).
"""
