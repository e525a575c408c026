"""Stand-ins shipped in the package, for the tests, the demo and the benchmark alike.

Each is a real server on 127.0.0.1 speaking the real wire format, so the product talks to it
through its own clients, exactly as it talks to the real service. Product code (``core``
outside this package, ``bot``, ``terminal``) never imports it: tests/test_layers.py checks.

server      what every stand-in shares (start, stop, URL; run one in a process of its own)
processes   running the product and the stand-ins as processes: a free port, a clean
            environment, a stand-in's URL read from it, a ``serve`` waited for until healthy
faults      faults at exact shares of the requests (the soak's and the benchmark's)
slack       the Slack Web API (calls recorded, messages as people see them, 429/500 on
            request), the request signer, and a client that sends what Slack sends
scripted    a model stand-in's server: scripted or computed replies, requests in flight,
            slowness, gates, stalls, cut streams
openai      OpenAI Chat Completions SSE (usage chunk included); the gated, soak and slow models
anthropic   Anthropic Messages SSE (message usage included)
otlp        an OTLP/HTTP trace receiver (a collector that keeps what it gets, or refuses, or hangs)
mcp_notes   a small MCP server (notes), over stdio or Streamable HTTP, with faults on request
tcp_proxy   a TCP proxy in front of a database that can cut every connection or blackhole them
"""
