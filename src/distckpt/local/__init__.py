"""Node-local checkpoints with peer replication: :class:`LocalCheckpointManager`."""

from .manager import LocalCheckpointManager, NotRecoverableLocallyError

__all__ = ["LocalCheckpointManager", "NotRecoverableLocallyError"]
