"""vLLM as the engine for presets with `engine: vllm`: its servers, a streaming adapter that speaks
the engine's event stream, and drafts made loadable by vLLM."""
