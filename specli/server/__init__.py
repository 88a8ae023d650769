"""`specli serve`: an OpenAI-compatible HTTP server over the speculative engine."""

from specli.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
