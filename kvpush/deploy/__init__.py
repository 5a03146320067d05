"""Launching vLLM servers and the router: the demo, end-to-end tests and benchmarks."""
