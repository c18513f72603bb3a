"""A digits classifier (UCI's handwritten digits, examples/data/) trained by
Lightning's Trainer with unison.lightning's strategy: the Lightning script
Horovod's strategy ran before Lightning 2.0, on current Lightning.

    unisonrun -np 2 python examples/lightning/digits.py

unisonrun starts the processes; each one's Trainer joins the job through the
strategy, trains on its shard of the data (Lightning adds the distributed
sampler) and averages gradients with the others. As with Horovod's strategy,
the learning rate is multiplied by the number of ranks: the global batch grew
that many times.
"""
import argparse
import os

import lightning.pytorch as pl
import numpy as np
import torch

import unison.lightning  # noqa: F401  (registers strategy="unison")
import unison.torch as hvd

# UCI's handwritten digits (the set scikit-learn bundles), split 3:1 into
# training and test rows once for every example: examples/data/README.md.
DIGITS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "data", "digits.npz")


class Classifier(pl.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
        self.lr = lr

    def training_step(self, batch, batch_index):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, sync_dist=True, prog_bar=True)  # averaged over the ranks
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--accumulate-grad-batches", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(1234)  # rank 0's weights are broadcast at setup whatever the others drew

    digits = np.load(DIGITS)
    train = torch.utils.data.TensorDataset(torch.tensor(digits["x_train"] / 16.0, dtype=torch.float32),
                                           torch.tensor(digits["y_train"]))
    model = Classifier(args.lr)
    trainer = pl.Trainer(strategy="unison", accelerator="cpu", devices=1, max_epochs=args.epochs,
                         accumulate_grad_batches=args.accumulate_grad_batches, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True))

    model.eval()
    with torch.no_grad():
        x_test = torch.tensor(digits["x_test"] / 16.0, dtype=torch.float32)
        accuracy = (model.net(x_test).argmax(1) == torch.tensor(digits["y_test"])).double().mean().item()
    weights = [p.detach() for p in model.parameters()]
    same = all(torch.equal(a, b) for a, b in zip(weights, hvd.broadcast_object(weights, root_rank=0)))
    if hvd.rank() == 0:
        print("epoch %d: loss %.4f" % (args.epochs, trainer.callback_metrics["loss"].item()), flush=True)
        print("test accuracy %.3f on %d ranks; weights identical on every rank: %s"
              % (accuracy, hvd.size(), same), flush=True)


if __name__ == "__main__":
    main()
