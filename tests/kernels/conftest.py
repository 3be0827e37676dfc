"""Kernel tests run Triton under its interpreter on CPU.

``triton.jit`` decides at decoration time whether a function is interpreted, and Triton's
own library functions (``tl.cdiv``, ...) are decorated when ``triton`` is imported, so
``TRITON_INTERPRET=1`` must be set before anything imports triton. Setting it here works as
long as no test module collected earlier imports a kernel module at import time; if one
does, fail loudly instead of with an obscure interpreter error.
"""

import os
import sys

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError(
        "triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1; "
        "set it in the environment or at the top of tests/conftest.py"
    )
os.environ["TRITON_INTERPRET"] = "1"
