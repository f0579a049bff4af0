"""An OpenAI-compatible HTTP server over the continuous-batching scheduler (``neuronfx serve``).

- ``protocol``: the request models (pydantic; unknown fields rejected as OpenAI does, vLLM's
  sampling extras accepted), their mapping to :class:`neuronfx.SamplingParams`, the response
  bodies and OpenAI's error JSON.
- ``engine``: one thread owns the runtime, the state and the scheduler queue; handlers submit
  requests and receive their token events through thread-safe queues.
- ``metrics``: the Prometheus metrics of one app (its own registry).
- ``app``: the FastAPI app (``make_app``): /v1/completions, /v1/chat/completions, /v1/models,
  /v1/models/{id}, /health (GET, HEAD), /metrics, /tokenize, /detokenize.
- ``serve``: uvicorn on a port bound before anything loads; SIGINT/SIGTERM drain in-flight
  requests (new ones get 503) before the process exits.
"""
