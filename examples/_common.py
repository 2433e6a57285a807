"""Pieces every example shares: flags, the digits data, the comparison with
one process, the final report and the workers' common exit.

Not part of keras_comm: a helper for the scripts in this directory. Nothing
here imports TensorFlow at module level, so `--help` answers instantly.
"""

import argparse
import json
import os


def parser(doc, epochs, batch_size, learning_rate):
    """An argument parser with the flags every example takes.

    Args:
        doc: the example's module docstring (its first paragraph is the
            description shown by --help).
        epochs, batch_size, learning_rate: the example's defaults.
    """
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--epochs", type=int, default=epochs, help="training epochs")
    p.add_argument(
        "--batch-size", type=int, default=batch_size,
        help="GLOBAL batch size (every replica works on its part of it)",
    )
    p.add_argument("--learning-rate", type=float, default=learning_rate, help="learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed for the data split and the initial weights")
    p.add_argument("--no-reference", action="store_true", help="skip the single-process reference run")
    p.add_argument("--results", default=None, help="write the final metrics as JSON to this file (chief only)")
    p.add_argument(
        "--train-samples", type=int, default=None,
        help="train on the first N training digits only, for a quick run (default: all 1,437)",
    )
    return p


def parse(p, argv=None, positive=("epochs", "batch_size")):
    """Parses `argv`; every flag named in `positive` must be >= 1."""
    args = p.parse_args(argv)
    for name in positive:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1. Received: {getattr(args, name)}")
    if getattr(args, "train_samples", None) is not None and args.train_samples < 1:
        p.error(f"--train-samples must be >= 1. Received: {args.train_samples}")
    return args


def quiet_tensorflow():
    """Silences TensorFlow's C++ start-up chatter unless the user set the level."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def load_digits(seed, images=False, train_samples=None):
    """scikit-learn's digits (shipped inside the package, no download).

    1,797 8x8 grey images of handwritten digits, scaled to [0, 1] and split
    80/20 (stratified, fixed seed).

    Args:
        seed: seed of the split.
        images: return images (N, 8, 8, 1) instead of flat vectors (N, 64).
        train_samples: keep only the first this many training samples (None:
            all); the test set is always whole.

    Returns:
        x_train, x_test, y_train, y_test (float32 inputs, int32 labels).
    """
    import numpy as np
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split

    x, y = sk_load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    if images:
        x = x.reshape(-1, 8, 8, 1)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y.astype(np.int32), test_size=0.2, random_state=seed, stratify=y
    )
    return x_train[:train_samples], x_test, y_train[:train_samples], y_test


def global_batches(x, y, batch_size, drop_remainder=False):
    """A tf.data pipeline of global batches that `fit` splits over the replicas.

    Every worker reads the same global batches and keeps its share of each
    (auto-shard policy DATA), so N workers see exactly the batches one
    process would.
    """
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size, drop_remainder=drop_remainder)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return ds.with_options(options)


def compile_classifier(model, learning_rate):
    """Compiles `model` as the digits classifiers are: Adam, cross-entropy on logits, accuracy."""
    import keras

    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def equal_share_digits(args, replicas):
    """The digits as global batches every replica takes an equal share of.

    Layers whose weights are split over the replicas (fully sharded ones)
    need equal per-replica batches: the training batches drop the last,
    partial one, and the test set is one batch cut to a multiple of
    `replicas`.

    Returns:
        (number of training samples, training batches, test batches).
    """
    x_train, x_test, y_train, y_test = load_digits(args.seed, train_samples=args.train_samples)
    if args.batch_size % replicas:
        raise SystemExit(
            f"--batch-size must be divisible by the {replicas} replicas. Received: {args.batch_size}"
        )
    train = global_batches(x_train, y_train, args.batch_size, drop_remainder=True)
    keep = len(x_test) - len(x_test) % replicas
    return len(x_train), train, global_batches(x_test[:keep], y_test[:keep], keep)


def chief_rank(strategy):
    """This worker's task index (0 is the chief, which prints)."""
    return strategy.cluster_resolver.task_id or 0


def max_rel_diff(weights_a, weights_b):
    """Largest |a - b| / max|b| over pairs of weight arrays."""
    import numpy as np

    return max(
        float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-12))
        for a, b in zip(weights_a, weights_b)
    )


def report(args, metric, results, chief=True):
    """Prints the final line (chief only) and writes `--results` as JSON.

    Args:
        args: parsed flags (uses `args.results`).
        metric: name of the metric in `results` (e.g. "accuracy"); the
            single-process value is read from ``"single_process_" + metric``.
        results: dict with at least "replicas" and `metric`.
        chief: only the chief prints and writes.
    """
    if not chief:
        return
    line = f"test {metric}, {results['replicas']} workers: {results[metric]:.4f}"
    reference = results.get("single_process_" + metric)
    if reference is not None:
        line += f" | single process: {reference:.4f}"
    if "max_weight_rel_diff" in results:
        line += f" | max relative weight difference: {results['max_weight_rel_diff']:.2e}"
    print(line, flush=True)
    if args.results:
        with open(args.results, "w") as f:
            json.dump(results, f)


def compare_fit(args, chief, results, full_weights, reference, train, test):
    """The chief trains `reference` on the same global batches, in this process alone.

    The tail of every `fit` example: unless --no-reference, the chief fits
    the unsplit `reference` (already holding the distributed model's
    initial weights) for ``args.epochs`` on `train`, evaluates it on `test`
    and adds ``single_process_accuracy`` and ``max_weight_rel_diff`` (against
    `full_weights`, the distributed model's weights gathered by every
    worker) to `results`. The other workers do nothing here; call
    `finish` afterwards so that they wait for the chief.
    """
    if chief and not args.no_reference:
        reference.fit(train, epochs=args.epochs, shuffle=False, verbose=0)
        _, ref_accuracy = reference.evaluate(test, verbose=0)
        results["single_process_accuracy"] = float(ref_accuracy)
        results["max_weight_rel_diff"] = max_rel_diff(full_weights, reference.get_weights())
    return results


def finish(strategy):
    """Every worker waits here for every other, then the example may exit (returns 0).

    The chief runs the single-process reference after the distributed run;
    a worker that exited meanwhile stops heartbeating to the chief's
    TensorFlow coordination service, which then logs that tasks have
    crashed and may abort the chief before it reports. One last collective
    (a sum of ones) that every worker joins after the reference keeps them
    all alive until the chief is done, so they leave together.
    """
    import tensorflow as tf

    def one():
        return tf.constant(1.0)

    # In a tf.function: an eager strategy.run warns of its overhead.
    ones = tf.function(lambda: strategy.run(one), autograph=False)()
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, ones, axis=None)
    if int(total) != strategy.num_replicas_in_sync:  # every replica joined once
        raise RuntimeError(
            f"The final barrier counted {int(total)} replicas. Received: "
            f"num_replicas_in_sync={strategy.num_replicas_in_sync}"
        )
    return 0
