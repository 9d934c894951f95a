"""Pluggable storage strategies and their registry keyed by ``(backend, version)``."""

from .base import (
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    get_default_strategy,
    register_default_strategy,
)
from .distckpt import DistCkptLoadShardedStrategy, DistCkptSaveShardedStrategy
from .torch_common import TorchLoadCommonStrategy, TorchSaveCommonStrategy

register_default_strategy(StrategyAction.SAVE_SHARDED, "distckpt", 1, DistCkptSaveShardedStrategy())
register_default_strategy(StrategyAction.LOAD_SHARDED, "distckpt", 1, DistCkptLoadShardedStrategy())
register_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1, TorchSaveCommonStrategy())
register_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1, TorchLoadCommonStrategy())

__all__ = [
    "StrategyAction",
    "SaveShardedStrategy",
    "LoadShardedStrategy",
    "SaveCommonStrategy",
    "LoadCommonStrategy",
    "DistCkptSaveShardedStrategy",
    "DistCkptLoadShardedStrategy",
    "TorchSaveCommonStrategy",
    "TorchLoadCommonStrategy",
    "register_default_strategy",
    "get_default_strategy",
]
