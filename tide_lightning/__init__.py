"""TIDE for Lightning: ``Trainer(strategy="tide_fsdp")`` or ``Trainer(strategy=TIDEFSDPStrategy(...))``.

Importing this package registers the strategy names with Lightning's registries (Trainer and
Fabric); Lightning snapshots the names when a Trainer/Fabric is constructed, so import first.
"""

from tide_lightning.callbacks import TIDEMetricsCallback
from tide_lightning.fabric import TIDEFabricStrategy
from tide_lightning.strategy import TIDEFSDPStrategy

TIDEFSDPStrategy.register_strategies()
TIDEFabricStrategy.register_strategies()

__all__ = ["TIDEFSDPStrategy", "TIDEFabricStrategy", "TIDEMetricsCallback"]
