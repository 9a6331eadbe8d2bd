"""Triton kernels; each has a torch reference it is tested against (tests/unit)."""
