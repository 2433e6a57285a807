"""Fully sharded data parallelism (ZeRO-3): a digits MLP whose every weight is split.

Run it on 2 (or 4) local worker processes:

    keras-comm-run -n 2 examples/fully_sharded.py

`keras_comm.parallel.fully_shard` copies the model with each weighted layer
wrapped in `keras_comm.parallel.FullyShard`: every worker persistently holds
1/N of each weight (flattened, padded) and 1/N of Adam's moments. A layer's
weights are all-gathered just before it runs and dropped afterwards; in the
backward they are gathered again, the layer's forward is recomputed and the
weight gradients are reduce-scattered, so each worker receives only its own
shard's gradient, already summed.

`model.fit` trains it like any model. Each worker prints the bytes its
replica holds (weights + optimizer state); the chief then trains the
unwrapped model (same initial weights, same global batches) in one process
and prints both test accuracies.
"""

import time

import _common


def parse_args(argv=None):
    p = _common.parser(__doc__, epochs=15, batch_size=64, learning_rate=3e-3)
    p.add_argument("--hidden", type=int, default=128, help="hidden units")
    return _common.parse(p, argv, positive=("epochs", "batch_size", "hidden"))


def build_model(hidden, learning_rate, seed):
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    return model


def main(argv=None):
    args = parse_args(argv)
    _common.quiet_tensorflow()
    import tensorflow as tf

    import keras_comm.parallel

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    n = strategy.num_replicas_in_sync
    chief = _common.chief_rank(strategy) == 0
    train_samples, train, test = _common.equal_share_digits(args, n)

    reference = _common.compile_classifier(build_model(args.hidden, args.learning_rate, args.seed), args.learning_rate)
    with strategy.scope():
        model = _common.compile_classifier(keras_comm.parallel.fully_shard(reference), args.learning_rate)
    if chief:
        print(
            f"Training on {train_samples} digits with {n} replicas, every weight "
            f"split {n} ways; global batch {args.batch_size}.",
            flush=True,
        )
    start = time.time()
    model.fit(train, epochs=args.epochs, shuffle=False, verbose=2 if chief else 0)
    seconds = time.time() - start
    state = keras_comm.parallel.replica_state_bytes(model)
    full_params = sum(int(w.numpy().size) for w in reference.weights)
    for rank, nbytes in sorted(state.items()):
        print(
            f"replica {rank}: {nbytes} bytes of weights + optimizer state "
            f"(unsharded: {3 * full_params * 4} bytes of weights + Adam moments)",
            flush=True,
        )
    _, accuracy = model.evaluate(test, verbose=0)
    results = {
        "replicas": n,
        "accuracy": float(accuracy),
        "seconds": seconds,
        "replica_state_bytes": {str(k): v for k, v in state.items()},
    }
    full = keras_comm.parallel.full_weights(model)  # every worker takes part
    _common.compare_fit(args, chief, results, full, reference, train, test)
    _common.report(args, "accuracy", results, chief)
    return _common.finish(strategy)


if __name__ == "__main__":
    raise SystemExit(main())
