"""`python -m pagoda.kernels.cpu`: build the CPU kernels into the extension cache now (the
Makefile's setup runs it). Without a C++ compiler it logs a warning and exits 0: pagoda runs on
torch's ops. A failed build (a compiler is there) exits 1 with the compiler's output, as does
any failure under PAGODA_CPU_KERNELS=require."""

import logging
import os
import sys

from pagoda.kernels.cpu import SWITCH, built, compiler

logging.basicConfig(level=logging.INFO, format="%(message)s")
if built() is None and (compiler() is not None or os.environ.get(SWITCH) == "require"):
    sys.exit(1)
