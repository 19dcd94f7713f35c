"""kvgate's HTTP server: OpenAI/SGLang-compatible proxy in front of a fleet of SGLang workers."""

__version__ = "0.1.0"
