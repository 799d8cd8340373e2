"""DeepSeek-family models built on Tilecraft's ops: config.json parsing, safetensors loading
(bf16 or FP8 block-scaled), layers, and tiny random checkpoints for tests (model.make_tiny).

The ops each layer calls are listed in model/kernels.py, one line each."""

from model.config import ModelConfig, config_from_dict, load_config
from model.deepseek_v3 import DeepseekV3, load_model
from model.mla import AttentionBatch
from model.weights import Checkpoint, CheckpointError

__all__ = ["ModelConfig", "config_from_dict", "load_config", "DeepseekV3", "load_model", "AttentionBatch",
           "Checkpoint", "CheckpointError"]
