"""Speculative decoding: proposers (n-gram, draft model) and exact verification.

config.py is plain data (no torch) that the scheduler may read; ngram.py proposes draft tokens
from a request's own tokens (numpy, on the host); rejection.py verifies drafts against the
target's distributions (torch).
"""
