"""The ViT model family: models by name, position-embedding resampling and weight I/O."""

from .config import TRAINING_SETTINGS, ModelConfig
from .factory import create_model, create_model_from_config
from .initializers import on_meta_device
from .io_npz import load_npz, save_npz
from .io_safetensors import load_safetensors, save_safetensors
from .io_timm import load_timm_state_dict, to_timm_state_dict
from .posemb import resample_posemb
from .variants import model_names
from .vit import VisionTransformer
from .weights import load_weights

__all__ = [
    "TRAINING_SETTINGS",
    "ModelConfig",
    "VisionTransformer",
    "create_model",
    "create_model_from_config",
    "load_npz",
    "load_safetensors",
    "load_timm_state_dict",
    "load_weights",
    "model_names",
    "on_meta_device",
    "resample_posemb",
    "save_npz",
    "save_safetensors",
    "to_timm_state_dict",
]
