"""The EAGLE-3 draft: its model, the vocabulary mapping, training (one process or data-parallel ranks), checkpoints,
the manifest a run trains on, and the export vLLM loads."""
