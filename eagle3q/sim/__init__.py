"""A vLLM-compatible simulator: the wire format of vLLM's OpenAI server, a latency model, and fault injection."""
