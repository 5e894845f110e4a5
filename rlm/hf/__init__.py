"""transformers integration: ``import rlm.hf`` registers model_type 'rlm' with AutoConfig and AutoModelForCausalLM.

``rlm export --ckpt CKPT --out DIR`` writes a folder that ``AutoModelForCausalLM.from_pretrained(DIR)`` loads
once rlm.hf is imported (extra ``hf-export``). ``import rlm`` does not register them: importing transformers'
model classes takes seconds, and ``import rlm`` stays instant.
"""

from rlm.hf.model import RLMConfig, RLMForCausalLM, plugin_specs, register

register()

__all__ = ["RLMConfig", "RLMForCausalLM", "plugin_specs", "register"]
