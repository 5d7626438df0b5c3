"""Object-store plane: torchft DiLoCo across trainer replicas, synchronised through an fsspec URI.

`DiLoCoConfig` (the topology's `diloco:` section) is import-cheap. The heavy parts live in submodules:
`store` (checksummed safetensors shards), `manager` (the torchft Manager stand-in, a façade over `rounds` +
`membership`, the round protocol, and `checkpoints`, with the state `codec`) and `diloco` (`ObjectStoreDiLoCo`,
the class a trainer hosts).
"""

from composer_mesh.mesh.objectstore.config import DiLoCoConfig, OuterOptimizerConfig

__all__ = ["DiLoCoConfig", "OuterOptimizerConfig"]
