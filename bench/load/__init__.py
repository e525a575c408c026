"""One ``slack-agent serve`` replica in a child process under load, measured from outside:
turns at once (``turns``), the acknowledgement under a wave of events (``ack``), what a
replica does per turn (``counts``, run in the replica's place), the floor under a turn on this
stack (``floor``), where the CPU goes (``profile``) and what one Slack call costs
(``slack_calls``)."""
