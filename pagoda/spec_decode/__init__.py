"""Speculative decoding: the proposers (n-gram; a draft model to come).

ngram.py proposes draft tokens from a request's own tokens (numpy, on the host), backing off per
request (backoff.py) where drafts keep failing. The config is pagoda.config.SpeculativeConfig
(plain data the scheduler may read); the verification is the runner's (runner/rejection_sampler.py).
"""
