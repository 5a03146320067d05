"""kvpush's vLLM connector; the only package that imports vLLM.

vLLM loads ``KVPushConnector`` from here via ``kv_connector_module_path``.
"""

from kvpush.vllm.connector import KVPushConnector

__all__ = ["KVPushConnector"]
