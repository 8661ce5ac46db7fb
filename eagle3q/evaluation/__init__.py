"""How good a draft is: the acceptance length offline against the target (with a bigram table as the baseline), on a
served vLLM speculating with it, and the pictures of both and of training."""
