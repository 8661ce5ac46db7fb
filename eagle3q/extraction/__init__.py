"""Hidden-state extraction: the transformers backend, vLLM's extract_hidden_states backend (its connector's files),
the consistency check of the states against the tokens, the first contact with an extraction server, and the
storage estimate."""
