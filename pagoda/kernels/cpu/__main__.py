"""`python -m pagoda.kernels.cpu`: build the CPU kernels into the extension cache now (the
Makefile's setup runs it). Where they cannot be built, the warning is logged and it exits 0:
pagoda runs on torch's ops."""

import logging

from pagoda.kernels.cpu import built

logging.basicConfig(level=logging.INFO, format="%(message)s")
built()
