"""Speculative decoding: the proposers (n-gram, draft model).

ngram.py proposes draft tokens from a request's own tokens (numpy, on the host); draft_model.py
from a draft model's greedy continuation, run through a forward the runner provides
(runner/draft_step.py). Both back off per request (backoff.py) where drafts keep failing. The
config is pagoda.config.SpeculativeConfig (plain data the scheduler may read); the verification
is the runner's (runner/rejection_sampler.py).
"""
