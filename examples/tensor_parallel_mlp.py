"""Tensor parallelism: a digits MLP whose weights are split across workers (Megatron-style).

Run it on 2 (or 4) local worker processes:

    keras-comm-run -n 2 examples/tensor_parallel_mlp.py
    keras-comm-run -n 4 examples/tensor_parallel_mlp.py --model-parallel 2

The hidden layer is a `keras_comm.parallel.ColumnParallelDense`: each
worker of a model group holds 1/k of its kernel's columns (k =
--model-parallel). The output layer is a `RowParallelDense`: each holds the
matching 1/k of its kernel's rows. Each worker computes its slice of the
hidden units for the whole group's batch (one all-gather of the inputs on
the way in), and the partial logits are summed with one reduce-scatter on
the way out. With --model-parallel smaller than the number of workers, the
replicas also form data-parallel groups (a `keras_comm.parallel.Mesh`), and
each weight shard's gradient is summed over its data-parallel group.

`model.fit` trains it like any model. The chief then trains the unsplit
model (two Dense layers, same initial weights, same global batches) in one
process and prints both test accuracies; the split weights are gathered
with `keras_comm.parallel.full_weights` for the weight comparison.
"""

import time

import _common


def parse_args(argv=None):
    p = _common.parser(__doc__, epochs=15, batch_size=64, learning_rate=3e-3)
    p.add_argument("--hidden", type=int, default=64, help="hidden units (split across the model group)")
    p.add_argument(
        "--model-parallel", type=int, default=0,
        help="workers per model group (0: all of them, no data parallelism)",
    )
    return _common.parse(p, argv, positive=("epochs", "batch_size", "hidden"))


def compile_model(model, learning_rate):
    import keras

    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def build_reference_model(hidden, learning_rate, seed):
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(10)]
    )
    return compile_model(model, learning_rate)


def build_split_model(hidden, learning_rate, mesh):
    import keras

    import keras_comm.parallel

    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras_comm.parallel.ColumnParallelDense(hidden, activation="relu", mesh=mesh),
            keras_comm.parallel.RowParallelDense(10, mesh=mesh),
        ]
    )
    return compile_model(model, learning_rate)


def main(argv=None):
    args = parse_args(argv)
    _common.quiet_tensorflow()
    import tensorflow as tf

    import keras_comm.parallel

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    n = strategy.num_replicas_in_sync
    k = args.model_parallel or n
    if n % k or args.hidden % k:
        raise SystemExit(
            "--model-parallel must divide the number of replicas and --hidden. "
            f"Received: --model-parallel {k} with {n} replicas, --hidden {args.hidden}"
        )
    # Rows of the mesh are data-parallel copies; columns split the weights.
    mesh = keras_comm.parallel.Mesh((n // k, k), ("data", "model"))
    chief = _common.chief_rank(strategy) == 0
    x_train, x_test, y_train, y_test = _common.load_digits(args.seed, train_samples=args.train_samples)
    if args.batch_size % n:
        raise SystemExit(f"--batch-size must be divisible by the {n} replicas. Received: {args.batch_size}")
    # The workers of a model group must hold equally many samples, so the
    # last, partial training batch is dropped and the test set (trimmed to a
    # multiple of n) is evaluated as one batch.
    train = _common.global_batches(x_train, y_train, args.batch_size, drop_remainder=True)
    keep = len(x_test) - len(x_test) % n
    test = _common.global_batches(x_test[:keep], y_test[:keep], keep)

    reference = build_reference_model(args.hidden, args.learning_rate, args.seed)
    with strategy.scope():
        model = build_split_model(args.hidden, args.learning_rate, mesh)
    keras_comm.parallel.set_full_weights(model, reference.get_weights())
    if chief:
        print(
            f"Training on {len(x_train)} digits with {n} replicas: model groups "
            f"{[list(g.ranks) for g in mesh.groups('model')]}, each worker holding "
            f"1/{k} of the weights; global batch {args.batch_size}.",
            flush=True,
        )
    start = time.time()
    model.fit(train, epochs=args.epochs, shuffle=False, verbose=2 if chief else 0)
    seconds = time.time() - start
    _, accuracy = model.evaluate(test, verbose=0)
    results = {"replicas": n, "model_parallel": k, "accuracy": float(accuracy), "seconds": seconds}
    full = keras_comm.parallel.full_weights(model)  # every worker takes part

    _common.compare_fit(args, chief, results, full, reference, train, test)
    _common.report(args, "accuracy", results, chief)
    return _common.finish(strategy)


if __name__ == "__main__":
    raise SystemExit(main())
