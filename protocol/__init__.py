"""Messages and codec shared by every verity process. Imports neither MLX nor aiohttp."""

from protocol.messages import PROTOCOL_VERSION  # noqa: F401
