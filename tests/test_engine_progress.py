"""What a person watching a vectorized run sees: the progress bar names the clients training together."""

from lightning.pytorch.callbacks import Callback

from lightning_fedrep import FederatedStrategy
from lightning_fedrep.lightning.progress import FederatedProgressBar
from tests.fixtures import quiet_trainer, tiny_datamodule
from tests.test_engine_equivalence import LossNet


class BarReader(Callback):
    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        bar = next(c for c in trainer.callbacks if isinstance(c, FederatedProgressBar))
        metrics = bar.get_metrics(trainer, pl_module)
        self.seen.append((metrics.get("clients"), metrics.get("client"), metrics.get("phase")))


def test_progress_bar_names_the_lockstep_clients_and_phase():
    reader = BarReader()
    strategy = FederatedStrategy(
        head="classifier", clients_per_round=4, head_epochs=1, body_epochs=1, runner="vectorized"
    )
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=1, limit_val_batches=0, enable_progress_bar=True, callbacks=[reader]
    )
    trainer.fit(LossNet(), datamodule=tiny_datamodule(num_clients=8))
    assert ("1-4/4", None, "head") in reader.seen
    assert ("1-4/4", None, "body") in reader.seen
    assert strategy.current_clients == ()
