"""atom_like: an ATOM-style LLM inference engine with EAGLE3 speculative decoding."""
from atom_like.config import EngineArgs
from atom_like.engine.llm_engine import LLMEngine
from atom_like.sampling_params import RequestOutput, SamplingParams, TokenLogprobs

__all__ = ["EngineArgs", "LLMEngine", "RequestOutput", "SamplingParams", "TokenLogprobs"]
