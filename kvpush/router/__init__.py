"""OpenAI-compatible router that sends the prefill and decode legs of a request at once."""

from kvpush.router.app import RouterConfig, make_app

__all__ = ["RouterConfig", "make_app"]
