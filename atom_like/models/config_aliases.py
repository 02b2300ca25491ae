"""Config model types that checkpoints use but transformers does not register.

`kimi_k2` (sglang's _KimiK2ConfigAlias from sgl-project/sglang#24826): Kimi-K2 text checkpoints and the
kimi-k2.5 EAGLE3-MLA drafts say `"model_type": "kimi_k2"`, which is DeepSeek-V3's config under
another name (their remote code subclasses it). transformers maps it to deepseek_v3 only inside
a Kimi-K2.5 `text_config`, so a top-level kimi_k2 config needs this alias to load.
"""
from __future__ import annotations

from transformers import AutoConfig, DeepseekV3Config
from transformers.models.auto.configuration_auto import CONFIG_MAPPING


class KimiK2Config(DeepseekV3Config):
    model_type = "kimi_k2"


def register_config_aliases() -> None:
    """Idempotent; defers to transformers should it ever register kimi_k2 itself."""
    if KimiK2Config.model_type not in CONFIG_MAPPING:
        AutoConfig.register(KimiK2Config.model_type, KimiK2Config)
