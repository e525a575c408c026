"""Faults at exact shares, for the stand-ins the soak and the benchmark run against."""

from __future__ import annotations


class FaultSchedule:
    """Which fault, if any, the next request meets: each at exactly its share of the requests,
    spread evenly. A random draw per request made a short run meet no fault of a rare kind now
    and then (a 1 % fault over 200 requests is absent about one run in eight), so a run could
    not prove it recovered from it; here ``n`` requests meet ``round(n * share)`` of each kind,
    whatever order concurrent requests arrive in. Two faults due on one request: the second
    waits for the next."""

    def __init__(self, **shares: float) -> None:
        self._shares = {name: share for name, share in shares.items() if share > 0}
        self._credit = dict.fromkeys(self._shares, 0.5)

    def next(self) -> str | None:
        for name, share in self._shares.items():
            self._credit[name] += share
        for name, credit in self._credit.items():
            if credit >= 1:
                self._credit[name] = credit - 1
                return name
        return None
