"""The peers' formats: a run's samples in speculators' and SpecForge's own layouts, for their trainers."""
