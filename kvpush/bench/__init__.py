"""`kvpush bench`: kvpush against vLLM's own NIXL connectors, and its own cost (issue 5)."""
