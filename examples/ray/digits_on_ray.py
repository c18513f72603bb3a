"""The digits classifier of examples/torch/digits.py, its ranks started by
Ray instead of unisonrun: with RayExecutor (horovod.ray's API), or with Ray
Train's UnisonTrainer (--ray-train).

    python examples/ray/digits_on_ray.py --num-workers 2
    python examples/ray/digits_on_ray.py --num-workers 2 --ray-train
    python examples/ray/digits_on_ray.py --num-workers 4 --address auto    (a running cluster)

Without --address it starts a Ray instance on this machine with a CPU per
worker. The training function is the torch example's, unchanged: it calls
hvd.init() and shards by hvd.rank() as under unisonrun.
"""
import argparse
import os
import sys

import ray

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_EXAMPLES = os.path.join(HERE, os.pardir, "torch")
sys.path.insert(0, TORCH_EXAMPLES)
import digits  # noqa: E402  (examples/torch/digits.py: this file is named otherwise, so actors find that one)

from unison.ray import RayExecutor, UnisonTrainer  # noqa: E402


def train_loop_per_worker(config):
    """Ray Train's training function: the torch example's, and a report."""
    import ray.train
    accuracy = digits.train(**config)
    ray.train.report({"test_accuracy": accuracy})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--ray-train", action="store_true", help="run it as a Ray Train job (UnisonTrainer)")
    parser.add_argument("--address", help="a Ray cluster to join (default: start one here)")
    args = parser.parse_args()

    # The actors import the torch example by name, as Ray pickles it.
    runtime_env = {"env_vars": {"PYTHONPATH": os.path.abspath(TORCH_EXAMPLES), "OMP_NUM_THREADS": "1"}}
    if args.address:
        ray.init(address=args.address, runtime_env=runtime_env)
    else:
        ray.init(num_cpus=args.num_workers, include_dashboard=False, runtime_env=runtime_env)

    if args.ray_train:
        trainer = UnisonTrainer(train_loop_per_worker, train_loop_config={"epochs": args.epochs},
                                scaling_config=ray.train.ScalingConfig(num_workers=args.num_workers))
        result = trainer.fit()
        if result.error is not None:
            raise result.error
        print("Ray Train: %d workers finished" % args.num_workers, flush=True)
    else:
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=args.num_workers)
        executor.start()
        try:
            accuracies = executor.run(digits.train, kwargs={"epochs": args.epochs})
        finally:
            executor.shutdown()
        print("RayExecutor: test accuracy %.3f on %d workers, the same on every worker: %s"
              % (accuracies[0], len(accuracies), len(set(accuracies)) == 1), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
