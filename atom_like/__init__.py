"""atom_like: an ATOM-style LLM inference engine built around EAGLE3 speculative decoding."""
