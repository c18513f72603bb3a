"""unison.lightning's UnisonStrategy inside every rank: Lightning's fit on N
shards ends with the parameters one process reaches on the whole batch
(with the learning rate the strategy scales, gradient accumulation, a
scheduler, and a checkpoint resumed), and the strategy's collectives give
exact values."""
import os

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")
import unison.lightning as ul  # noqa: E402
import unison.torch as hvd  # noqa: E402

torch.set_num_threads(1)
ROWS, FEATURES, OUTPUTS = 48, 5, 3   # 48 rows: whole batches at 1, 2 and 3 ranks
BATCH = 4                             # per rank


def data():
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(ROWS, FEATURES, generator=generator, dtype=torch.float64)
    y = x @ torch.randn(FEATURES, OUTPUTS, generator=generator, dtype=torch.float64) + 0.1
    return torch.utils.data.TensorDataset(x, y)


class Regression(pl.LightningModule):
    def __init__(self, seed, lr):
        super().__init__()
        torch.manual_seed(seed)
        self.layer = torch.nn.Linear(FEATURES, OUTPUTS, dtype=torch.float64)
        self.lr = lr

    def training_step(self, batch, batch_index):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, sync_dist=True)   # reduced through the strategy
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


def trainer(strategy, epochs, accumulate, **options):
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=epochs,
                      accumulate_grad_batches=accumulate, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, **options)


def one_process(epochs, accumulate, lr):
    """What one process reaches on the whole batch (N ranks' batches at
    once), with the rate the strategy gives the N ranks. Lightning shuffles
    training data through the DistributedSampler it adds (seed 0, reseeded
    each epoch), whose rank r takes rows r, r + N, ... of each epoch's
    permutation: step s of the N ranks together reads the permutation's
    rows N*BATCH*s onwards, which one process reads in order from the same
    sampler over one replica."""
    model = Regression(seed=0, lr=lr * hvd.size())
    rows = data()
    loader = torch.utils.data.DataLoader(rows, batch_size=BATCH * hvd.size(),
                                         sampler=torch.utils.data.DistributedSampler(rows, num_replicas=1, rank=0))
    trainer(pl.strategies.SingleDeviceStrategy(torch.device("cpu")), epochs, accumulate).fit(model, loader)
    return [p.detach().clone() for p in model.parameters()]


def assert_parameters(model, expected):
    for got, want in zip(model.parameters(), expected):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-10)
    mine = [p.detach() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(mine, hvd.broadcast_object(mine, root_rank=0)))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_fit_matches_one_process_on_the_whole_batch(accumulate):
    # Each rank starts from other weights: rank 0's are broadcast at setup.
    model = Regression(seed=hvd.rank(), lr=0.05)
    loader = torch.utils.data.DataLoader(data(), batch_size=BATCH, shuffle=False)
    fit = trainer(ul.UnisonStrategy(), 2, accumulate)
    fit.fit(model, loader)
    assert fit.global_rank == hvd.rank() and fit.world_size == hvd.size()
    assert fit.strategy.optimizers[0].backward_passes_per_step == accumulate
    assert_parameters(model, one_process(2, accumulate, 0.05))


def test_a_resumed_fit_matches_one_uninterrupted_process(tmp_path):
    folder = hvd.broadcast_object(str(tmp_path), root_rank=0)   # rank 0 writes, every rank reads
    path = os.path.join(folder, "epoch1.ckpt")
    first = trainer(ul.UnisonStrategy(), 1, 2)
    first.fit(Regression(seed=hvd.rank(), lr=0.05), torch.utils.data.DataLoader(data(), batch_size=BATCH))
    first.save_checkpoint(path)
    assert os.path.exists(path)
    # Fresh weights everywhere (rank 0's too): the checkpoint, momentum and
    # scheduler included, is what the resumed job goes on from.
    model = Regression(seed=100 + hvd.rank(), lr=0.05)
    trainer(ul.UnisonStrategy(), 3, 2).fit(model, torch.utils.data.DataLoader(data(), batch_size=BATCH),
                                           ckpt_path=path)
    assert_parameters(model, one_process(3, 2, 0.05))


def test_the_learning_rate_is_kept_as_configured_when_asked():
    model = Regression(seed=hvd.rank(), lr=0.05 * hvd.size())
    trainer(ul.UnisonStrategy(scale_learning_rate=False), 2, 1).fit(
        model, torch.utils.data.DataLoader(data(), batch_size=BATCH))
    assert_parameters(model, one_process(2, 1, 0.05))


def test_the_strategy_by_name_and_its_collectives():
    fit = trainer("unison", 1, 1)
    strategy = fit.strategy
    assert isinstance(strategy, ul.UnisonStrategy)
    fit.fit(Regression(seed=0, lr=0.01), torch.utils.data.DataLoader(data(), batch_size=BATCH))
    r, n = hvd.rank(), hvd.size()
    assert strategy.is_global_zero == (r == 0) and strategy.local_rank == hvd.local_rank()
    assert strategy.distributed_sampler_kwargs == {"num_replicas": n, "rank": r}
    mine = torch.tensor([r + 1.0, 10.0 * r], dtype=torch.float64)
    assert strategy.reduce(mine, reduce_op="sum").tolist() == [n * (n + 1) / 2, 10.0 * n * (n - 1) / 2]
    assert strategy.reduce(mine).tolist() == [(n + 1) / 2, 10.0 * (n - 1) / 2]
    assert strategy.reduce(mine, reduce_op=torch.distributed.ReduceOp.MAX).tolist() == [n, 10.0 * (n - 1)]
    assert strategy.reduce("not a tensor") == "not a tensor"
    gathered = strategy.all_gather(torch.full((2, 2), float(r)))
    assert gathered.shape == (n, 2, 2) and [gathered[k].unique().item() for k in range(n)] == list(range(n))
    assert strategy.all_gather(torch.tensor(r)).tolist() == list(range(n))
    assert strategy.broadcast({"from": r}, src=n - 1) == {"from": n - 1}
    assert strategy.reduce_boolean_decision(r == 0, all=False) is True
    assert strategy.reduce_boolean_decision(r == 0, all=True) is (n == 1)
    strategy.barrier("after the checks")
    with pytest.raises(ValueError, match="reduce_op='median'"):
        strategy.reduce(mine, reduce_op="median")
    with pytest.raises(ValueError, match="process group"):
        strategy.reduce(mine, group=object())
