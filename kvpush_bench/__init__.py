"""The test and benchmark harness around kvpush; not part of the product.

``python -m kvpush_bench <sub-command>`` runs it: ``demo`` (the synthetic engine-free demo),
``faults``, ``soak``, ``fuzz`` (reliability runs over real NIXL) and ``bench`` (kvpush against
vLLM's own NIXL connectors, and its own cost; issue 5). ``sim/`` holds the simulated engines,
``vllm_gpu.py`` the real-vLLM GPU benchmark. kvpush_bench imports kvpush; kvpush never
imports kvpush_bench.
"""
