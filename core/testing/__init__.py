"""Stand-in servers shipped in the package, used by the demo, the benchmark and the tests alike."""
