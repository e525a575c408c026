"""Tools that measure and prove the product rather than being it, one folder per family:
``costs`` (what the core's operations cost, with no model: ``slack-agent bench``), ``load``
(one ``serve`` replica under many turns at once, and its floor), ``soak`` (replicas under load
and faults, then every promise checked: ``slack-agent soak``), ``peers`` (our storage against
other libraries': ``slack-agent bench --compare``). What they share is ``bench.common``; no
benchmark imports another family's module, and the product never imports any of it."""
