"""The digits classifier of examples/torch/digits.py, its ranks run as Spark
tasks by unison.spark.run (horovod.spark.run's API).

    python examples/spark/digits_on_spark.py --num-proc 2
    spark-submit examples/spark/digits_on_spark.py --num-proc 8     (a cluster: unison installed on its executors)

Without spark-submit it starts Spark in local mode with a task slot per
rank. Spark needs Java 17 or later (JAVA_HOME). The training function is
the torch example's, unchanged: it calls hvd.init() and shards by
hvd.rank() as under unisonrun.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_EXAMPLES = os.path.abspath(os.path.join(HERE, os.pardir, "torch"))
sys.path.insert(0, TORCH_EXAMPLES)
import digits  # noqa: E402  (examples/torch/digits.py: this file is named otherwise, so tasks find that one)

import unison.spark  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()

    # Spark's Python workers import the torch example by name, as Spark
    # pickles it, and in local mode run this Python.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TORCH_EXAMPLES, os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from pyspark.sql import SparkSession
    builder = SparkSession.builder.appName("unison digits")
    if not os.environ.get("SPARK_ENV_LOADED"):  # not under spark-submit, which says where to run
        builder = builder.master("local[%d]" % args.num_proc).config("spark.ui.showConsoleProgress", "false")
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")

    accuracies = unison.spark.run(digits.train, kwargs={"epochs": args.epochs}, num_proc=args.num_proc)
    print("unison.spark.run: test accuracy %.3f on %d ranks, the same on every rank: %s"
          % (accuracies[0], len(accuracies), len(set(accuracies)) == 1), flush=True)
    spark.stop()


if __name__ == "__main__":
    main()
