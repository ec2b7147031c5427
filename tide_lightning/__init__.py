"""TIDE for Lightning: ``Trainer(strategy="tide_fsdp")`` or ``Trainer(strategy=TIDEFSDPStrategy(...))``.

Importing this package registers the strategy names with Lightning's registries (Trainer and
Fabric); Lightning snapshots the names when a Trainer/Fabric is constructed, so import first.
Needs the ``lightning`` extra; without it the import fails with an error that names the extra.
"""

from tide_core.extras import require_extra

require_extra("lightning", ["lightning"], "tide_lightning")

from tide_lightning.callbacks import TIDEMetricsCallback  # noqa: E402
from tide_lightning.fabric import TIDEFabricStrategy  # noqa: E402
from tide_lightning.strategy import TIDEFSDPStrategy  # noqa: E402

TIDEFSDPStrategy.register_strategies()
TIDEFabricStrategy.register_strategies()

__all__ = ["TIDEFSDPStrategy", "TIDEFabricStrategy", "TIDEMetricsCallback"]
