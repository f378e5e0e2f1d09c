"""`mlxspec serve`: an OpenAI-compatible HTTP server with speculative decoding.

- `app`: routes, validation, SSE streaming, the command line (Starlette on uvicorn);
- `worker`: the generation thread (one generation at a time, bounded queue, metrics);
- `prompt_cache`: the LRU prefix cache of target KV caches and drafter context.
"""

from mlxspec.server.app import add_serve_args, cmd_serve

__all__ = ["add_serve_args", "cmd_serve"]
