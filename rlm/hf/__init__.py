"""transformers integration: ``import rlm.hf`` registers model_type 'rlm' with AutoConfig and AutoModelForCausalLM.

``rlm export --ckpt CKPT --out DIR`` (extra ``hf-export``) writes a LlamaForCausalLM folder for a model without
plugins, and otherwise rlm's own model with its source and an ``auto_map``, which
``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` loads without rlm installed; where rlm is
installed, ``import rlm.hf`` lets it load without remote code. ``import rlm`` does not register them: importing
transformers' model classes takes seconds, and ``import rlm`` stays instant.
"""

from rlm.hf.model import RLMConfig, RLMForCausalLM, plugin_specs, register

register()

__all__ = ["RLMConfig", "RLMForCausalLM", "plugin_specs", "register"]
