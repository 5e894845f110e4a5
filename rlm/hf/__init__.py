"""transformers integration: ``import rlm.hf`` registers model_type 'rlm' with AutoConfig and AutoModelForCausalLM,
so exported folders load without remote code. ``import rlm`` does not: importing transformers' model classes takes
seconds.
"""

from rlm.hf.model import RLMConfig, RLMForCausalLM

__all__ = ["RLMConfig", "RLMForCausalLM"]
