"""Stand-in servers shipped in the package, for the tests, the demo and the benchmark alike.

otlp        an OTLP/HTTP trace receiver (a collector that keeps what it gets, or refuses, or hangs)
mcp_notes   a small MCP server (notes), over stdio or Streamable HTTP, with faults on request
tcp_proxy   a TCP proxy in front of a database that can cut every connection or blackhole them
"""
