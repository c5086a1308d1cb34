"""Training frameworks that rebuild the user's loader keep fastmm's.

Lightning, when it trains on several processes, builds a new loader of the user's class with a
DistributedSampler in place of the sampler, from the arguments the loader was made with; the new
one must be a fastmm.DataLoader with fastmm's own keyword too, and the ranks together must see
every sample once per epoch. (Accelerate's ``prepare`` builds torch's own DataLoader instead:
docs/loader.md says what to do there.)
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import fastmm


L = pytest.importorskip("lightning")


class Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        return torch.full((4,), float(i)), i


class Recorder(L.LightningModule):
    """A tiny model that writes, per rank and epoch, the loader it was given and the sample ids
    it trained on."""

    def __init__(self, out_dir: str):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.out_dir = out_dir
        self.seen: list[int] = []

    def training_step(self, batch, _):
        x, ids = batch
        self.seen += ids.tolist()
        return self.layer(x).pow(2).mean()

    def on_train_epoch_end(self) -> None:
        loader = self.trainer.train_dataloader
        record = {"class": f"{type(loader).__module__}.{type(loader).__qualname__}",
                  "sampler": type(loader.sampler).__name__,
                  "num_workers": loader.num_workers,
                  "on_worker_failure": loader.on_worker_failure,
                  "ids": self.seen}
        path = os.path.join(self.out_dir, f"rank{self.global_rank}-epoch{self.current_epoch}.json")
        with open(path, "w") as f:
            json.dump(record, f)
        self.seen = []

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.slow
def test_lightning_rebuilds_a_fastmm_loader_for_each_rank(tmp_path):
    loader = fastmm.DataLoader(Numbers(), batch_size=4, num_workers=2, shuffle=True,
                               persistent_workers=True, on_worker_failure="respawn")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Recorder(str(tmp_path)), loader)
    for epoch in range(2):
        records = [json.loads((tmp_path / f"rank{r}-epoch{epoch}.json").read_text())
                   for r in range(2)]
        for record in records:
            assert record["class"] == "fastmm.loader.DataLoader"
            assert record["sampler"] == "DistributedSampler"
            assert (record["num_workers"], record["on_worker_failure"]) == (2, "respawn")
            assert len(record["ids"]) == 20
        assert sorted(records[0]["ids"] + records[1]["ids"]) == list(range(40))


def test_lightning_shuts_a_fastmm_loaders_persistent_workers_down():
    """Lightning ends persistent workers between loops through an isinstance check for torch's
    multi-process iterator: fastmm's passes it, and the workers go then, not when (or if) the
    iterator is collected."""
    from lightning.pytorch.utilities.combined_loader import _shutdown_workers_and_reset_iterator

    loader = fastmm.DataLoader(Numbers(), batch_size=8, num_workers=2, persistent_workers=True)
    it = iter(loader)  # still held here, as a loop's frame may hold it
    next(it)
    workers = list(it._workers)
    _shutdown_workers_and_reset_iterator(loader)
    assert loader._iterator is None
    assert not any(w.is_alive() for w in workers)
