"""Expert parallelism: a digits classifier with a mixture-of-experts layer split across workers.

Run it on 2 (or 4) local worker processes:

    keras-comm-run -n 2 examples/mixture_of_experts.py

The middle of the model is a `keras_comm.parallel.MixtureOfExperts` with
--experts experts, each a Dense layer; each worker holds --experts / N of
them. A router (an ordinary, mirrored Dense) picks the --top-k experts of
every sample; an AlltoAll sends each sample to the workers holding its
experts, the experts run there, and a second AlltoAll brings the results
back, weighted by the router's gates. Backward, each AlltoAll's gradient is
the reverse AlltoAll, so every expert gets the gradient of all the samples
routed to it, from every worker.

Capacity: by default every expert has room for all of a worker's samples
(--capacity-factor = experts / top-k), so no choice is ever dropped and the
layer computes exactly what one process computes. With a smaller factor an
expert that is full drops the extra samples (they pass through the residual
connection only); which ones are dropped then depends on how the batch is
split, and the single-process reference is no longer the same model.

`model.fit` trains it. The chief then trains the same model in one process
(all experts local) on the same global batches and prints both test
accuracies.
"""

import time

import _common


def parse_args(argv=None):
    p = _common.parser(__doc__, epochs=15, batch_size=64, learning_rate=3e-3)
    p.add_argument("--hidden", type=int, default=32, help="width of the representation the experts transform")
    p.add_argument("--experts", type=int, default=4, help="number of experts (divisible by the number of workers)")
    p.add_argument("--top-k", type=int, default=2, help="experts per sample")
    p.add_argument(
        "--capacity-factor", type=float, default=None,
        help="expert slots relative to an even split (default experts/top-k: nothing is dropped)",
    )
    args = _common.parse(p, argv, positive=("epochs", "batch_size", "hidden", "experts", "top_k"))
    if args.capacity_factor is None:
        args.capacity_factor = args.experts / args.top_k
    return args


def build_model(args):
    import keras

    import keras_comm.parallel

    keras.utils.set_random_seed(args.seed)
    inputs = keras.Input((64,))
    h = keras.layers.Dense(args.hidden, activation="relu")(inputs)
    experts = keras_comm.parallel.MixtureOfExperts(
        num_experts=args.experts, units=args.hidden, top_k=args.top_k,
        capacity_factor=args.capacity_factor, activation="relu", seed=args.seed,
    )(h)
    h = keras.layers.Add()([h, experts])  # residual: dropped choices pass through
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
    model.compile(
        optimizer=keras.optimizers.Adam(args.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def main(argv=None):
    args = parse_args(argv)
    _common.quiet_tensorflow()
    import tensorflow as tf

    import keras_comm.parallel

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    n = strategy.num_replicas_in_sync
    if args.experts % n or args.batch_size % n:
        raise SystemExit(
            f"--experts and --batch-size must be divisible by the {n} replicas. "
            f"Received: --experts {args.experts}, --batch-size {args.batch_size}"
        )
    chief = _common.chief_rank(strategy) == 0
    x_train, x_test, y_train, y_test = _common.load_digits(args.seed, train_samples=args.train_samples)
    # Every worker must hold equally many samples (the AlltoAll exchanges
    # equal blocks): drop the last, partial training batch and evaluate the
    # test set (trimmed to a multiple of n) as one batch.
    train = _common.global_batches(x_train, y_train, args.batch_size, drop_remainder=True)
    keep = len(x_test) - len(x_test) % n
    test = _common.global_batches(x_test[:keep], y_test[:keep], keep)

    reference = build_model(args)  # outside the strategy: one process, all experts
    with strategy.scope():
        model = build_model(args)
    keras_comm.parallel.set_full_weights(model, reference.get_weights())
    if chief:
        print(
            f"Training on {len(x_train)} digits: {args.experts} experts, {args.experts // n} per worker, "
            f"top-{args.top_k} routing, capacity factor {args.capacity_factor:g}.",
            flush=True,
        )
    start = time.time()
    model.fit(train, epochs=args.epochs, shuffle=False, verbose=2 if chief else 0)
    seconds = time.time() - start
    _, accuracy = model.evaluate(test, verbose=0)
    results = {"replicas": n, "accuracy": float(accuracy), "seconds": seconds}
    full = keras_comm.parallel.full_weights(model)  # every worker takes part

    _common.compare_fit(args, chief, results, full, reference, train, test)
    _common.report(args, "accuracy", results, chief)
    return _common.finish(strategy)


if __name__ == "__main__":
    raise SystemExit(main())
