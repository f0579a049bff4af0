"""An OpenAI-compatible HTTP server over the continuous-batching scheduler (``neuronfx serve``).

- ``protocol``: the request models (pydantic; unknown fields rejected as OpenAI does, vLLM's
  sampling extras accepted), their mapping to :class:`neuronfx.SamplingParams`, the response
  bodies and OpenAI's error JSON.
- ``engine``: one thread owns the runtime, the state and the scheduler queue; handlers submit
  requests and receive their token events through thread-safe queues.
- ``served``: what the engine serves (runtime, tokenizer, grammars) and the prompt-size bound
  handlers check before tokenizing.
- ``metrics``: the Prometheus metrics of one app (its own registry).
- ``structured``: response_format, structured_outputs and guided_* as one StructuredOutputs.
- ``tools`` and ``tool_parsers``: tool_choice as a grammar or a parser; tool calls read from text,
  whole and streamed.
- ``responses_api`` and ``response_events``: OpenAI's Responses API (/v1/responses), its
  conversation store and its typed stream events.
- ``app``: the FastAPI app (``make_app``): /v1/completions, /v1/chat/completions, /v1/responses,
  /v1/models, /v1/models/{id}, /health (GET, HEAD), /metrics, /tokenize, /detokenize.
- ``serve``: uvicorn on a port bound before anything loads; SIGINT/SIGTERM drain in-flight
  requests (new ones get 503) before the process exits.
"""
