"""speclab: an EAGLE-3 speculative-decoding lab for vLLM."""

__version__ = "0.1.0"
