"""PyTorch Lightning on spark_hvd: a Lightning strategy for scripts run by ``spark-hvd-run`` or
``spark_hvd.spark.run``, and the one ``LightningEstimator`` trains with.

    import lightning as L
    from spark_hvd.lightning import SparkHvdStrategy

    trainer = L.Trainer(strategy=SparkHvdStrategy(), accelerator="cpu", devices=1,
                        max_epochs=3)
    trainer.fit(model, train_loader)      # one process per rank; gradients averaged

``SparkHvdStrategy`` (also ``HorovodStrategy``, Lightning 1.x's name) is built for the
``lightning`` package; ``strategy_class("pytorch_lightning")`` gives the one for the standalone
``pytorch_lightning`` package. Nothing here imports Lightning until a strategy is asked for.
"""

from ._strategy import import_lightning, package_of, strategy_class

__all__ = ["SparkHvdStrategy", "HorovodStrategy", "SparkHvdEnvironment", "strategy_class",
           "package_of", "import_lightning"]


def __getattr__(name):
    if name in ("SparkHvdStrategy", "HorovodStrategy"):
        return strategy_class("lightning.pytorch")
    if name == "SparkHvdEnvironment":
        return strategy_class("lightning.pytorch").Environment
    raise AttributeError(f"module 'spark_hvd.lightning' has no attribute {name!r}")
