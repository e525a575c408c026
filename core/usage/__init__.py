"""Usage, prices and budgets, without SQL (the accounts themselves live in the storage layer).

prices   the US-dollar cost of one request: genai-prices' table, a provider's own prices
totals   RequestUsage (one request, priced) and MessageUsage (a message's metadata.usage)
budgets  BUDGETS entries, their UTC windows, and the decision whether a turn may go on

Import from the modules: this package imports nothing, because ``core.settings`` parses
``BUDGETS`` with ``budgets`` and must not pull the providers (which import the settings) in.
"""
