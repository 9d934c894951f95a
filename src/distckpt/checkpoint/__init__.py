"""Checkpoints of models, optimizers and arbitrary state dicts (OLMo-core's
``olmo_core.distributed.checkpoint`` API) on distckpt's engine and format.

Save from FSDP2 (DTensor), DDP or a plain module on N ranks; load into any other topology, or
into a single process without ``torch.distributed``; unshard into ``torch.load``-able or
safetensors files.

>>> save_model_and_optim_state("ckpt/step100", model, optim)
>>> load_model_and_optim_state("ckpt/step100", model, optim)   # any world size / wrapping
>>> unshard_checkpoint("ckpt/step100", "export", use_safetensors=True)
"""

from .adapters import dtensor_box, flatten
from .api import (
    async_save_model_and_optim_state,
    async_save_state_dict,
    load_model_and_optim_state,
    load_state_dict,
    save_model_and_optim_state,
    save_state_dict,
)
from .unshard import (
    CheckpointInfo,
    ObjectMetadata,
    TensorMetadata,
    UnshardStrategy,
    UnshardStrategyType,
    get_checkpoint_metadata,
    load_keys,
    unshard_checkpoint,
)

__all__ = [
    "CheckpointInfo",
    "ObjectMetadata",
    "TensorMetadata",
    "UnshardStrategy",
    "UnshardStrategyType",
    "async_save_model_and_optim_state",
    "async_save_state_dict",
    "dtensor_box",
    "flatten",
    "get_checkpoint_metadata",
    "load_keys",
    "load_model_and_optim_state",
    "load_state_dict",
    "save_model_and_optim_state",
    "save_state_dict",
    "unshard_checkpoint",
]
