"""Model architectures, keyed by the HF `architectures` name."""

from .config import SUPPORTED_ARCHITECTURES, ModelConfig, config_from_gguf, config_from_hf, config_to_hf
from .llama import Transformer

# The Llama file covers every supported family; a new family adds its module here.
REGISTRY = {name: Transformer for name in SUPPORTED_ARCHITECTURES}


def build_model(cfg: ModelConfig):
    return REGISTRY[cfg.architecture](cfg)


__all__ = ["REGISTRY", "ModelConfig", "build_model", "config_from_gguf", "config_from_hf", "config_to_hf"]
