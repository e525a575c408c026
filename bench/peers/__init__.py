"""``slack-agent bench --compare``: one workload (``compare``) for our storage and for the
peers' (``libraries``), each behind the same small interface (``conversation``)."""
