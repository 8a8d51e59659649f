"""llmrun: fast local LLM inference on one machine."""

__version__ = "0.1.0"
