"""deltaserve: serving hybrid linear-attention LLMs (Kimi Linear) on PyTorch."""
from .llm import LLM

__all__ = ["LLM"]
