"""`mlxspec serve`: an OpenAI-compatible HTTP server with speculative decoding.

- `args`: the command line flags;
- `app`: routes, validation, SSE streaming, `cmd_serve` (Starlette on uvicorn);
- `compat`: the Anthropic Messages (/v1/messages) and OpenAI Responses (/v1/responses) APIs;
- `worker`: the generation thread (continuous batching through `engine.batch`, or one generation at a
  time with `--max-batch 1`; bounded queue, metrics);
- `prompt_cache`: the LRU prefix cache of target KV caches and drafter context.
"""
