"""Data-parallel training of a digits classifier with model.fit across workers.

Run it on 2 local worker processes (the launcher sets TF_CONFIG):

    keras-comm-run -n 2 examples/data_parallel.py

Each worker trains the same model on its share of every global batch; the
chief (rank 0) then trains the same model in a single process on the same
global batches and prints both accuracies. With keras_comm's exact
multi-worker fit they agree to float32 round-off.

The data is scikit-learn's handwritten digits (1,797 8x8 images), which ships
inside the scikit-learn package: nothing is downloaded.
"""

import argparse
import json
import os
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=15, help="training epochs")
    parser.add_argument("--batch-size", type=int, default=64, help="GLOBAL batch size (split across all replicas)")
    parser.add_argument("--learning-rate", type=float, default=3e-3, help="Adam learning rate")
    parser.add_argument("--hidden", type=int, default=64, help="hidden units")
    parser.add_argument("--seed", type=int, default=0, help="seed for the split and the initial weights")
    parser.add_argument("--no-reference", action="store_true", help="skip the single-process reference run")
    parser.add_argument("--results", default=None, help="write the final metrics as JSON to this file (chief only)")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "hidden"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1. Received: {getattr(args, name)}")
    return args


def load_digits(seed):
    """Digits scaled to [0, 1], split 80/20 with a fixed seed."""
    import numpy as np
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split

    x, y = sk_load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return train_test_split(x, y.astype(np.int32), test_size=0.2, random_state=seed, stratify=y)


def build_model(hidden, learning_rate, seed):
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def make_dataset(x, y, batch_size):
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    options = tf.data.Options()
    # Every worker reads the same global batches and keeps its share of each.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return ds.with_options(options)


def main(argv=None):
    args = parse_args(argv)
    # Quiet TensorFlow's C++ start-up chatter unless the user asked for it.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    import keras_comm  # noqa: F401  (makes model.fit work under MWMS)

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.task_id or 0
    chief = rank == 0
    x_train, x_test, y_train, y_test = load_digits(args.seed)
    train = make_dataset(x_train, y_train, args.batch_size)
    test = make_dataset(x_test, y_test, args.batch_size)

    with strategy.scope():
        model = build_model(args.hidden, args.learning_rate, args.seed)
    if chief:
        print(
            f"Training on {len(x_train)} digits with {strategy.num_replicas_in_sync} replicas, "
            f"global batch {args.batch_size}.",
            flush=True,
        )
    start = time.time()
    model.fit(train, epochs=args.epochs, shuffle=False, verbose=2 if chief else 0)
    seconds = time.time() - start
    _, accuracy = model.evaluate(test, verbose=0)
    results = {"replicas": strategy.num_replicas_in_sync, "accuracy": float(accuracy), "seconds": seconds}

    if chief and not args.no_reference:
        # The same model on the same global batches, in this process alone.
        single = build_model(args.hidden, args.learning_rate, args.seed)
        single.fit(make_dataset(x_train, y_train, args.batch_size), epochs=args.epochs, shuffle=False, verbose=0)
        _, reference = single.evaluate(make_dataset(x_test, y_test, args.batch_size), verbose=0)
        results["single_process_accuracy"] = float(reference)
        results["max_weight_rel_diff"] = max(
            float(abs(a - b).max() / max(abs(b).max(), 1e-12))
            for a, b in zip(model.get_weights(), single.get_weights())
        )
    if chief:
        line = f"test accuracy, {results['replicas']} workers: {accuracy:.4f}"
        if "single_process_accuracy" in results:
            line += (
                f" | single process: {results['single_process_accuracy']:.4f}"
                f" | max relative weight difference: {results['max_weight_rel_diff']:.2e}"
            )
        print(line, flush=True)
        if args.results:
            with open(args.results, "w") as f:
                json.dump(results, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
