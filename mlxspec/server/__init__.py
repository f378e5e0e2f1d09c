"""`mlxspec serve`: an OpenAI-compatible HTTP server with speculative decoding.

- `args`: the command line flags;
- `app`: the Starlette app (`build_app`: routes, error handlers) and `cmd_serve` (uvicorn);
- `state`: `Server`, what the handlers share; `params`: request parsing and validation; `errors`:
  `APIError` and the OpenAI error object; `tools`: tool-call parsing; `jobs`: queueing a job,
  disconnects and the non-streaming `collect`; `sse`: streamed responses;
- `completions`: /v1/chat/completions and /v1/completions; `status`: /health, /v1/models, /metrics;
- `compat`: the Anthropic Messages (/v1/messages) and OpenAI Responses (/v1/responses) APIs;
- `job`: `Job`, one request on the generation thread; `worker`: that thread (loading, the bounded
  queue, the drafter pool), running jobs through `batched` (continuous batching through
  `engine.batch`) or `sequential` (one generation at a time with `--max-batch 1`); `text`: a job's
  tokens -> the text sent; `metrics`: the counters behind /metrics;
- `prompt_cache`: the LRU prefix cache of target KV caches and drafter context.
"""
