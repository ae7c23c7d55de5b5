"""deltaserve: serving hybrid linear-attention LLMs (Kimi Linear) on PyTorch."""
from .llm import LLM, RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
