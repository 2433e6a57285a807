"""Spatial parallelism: a CNN over digit images split into horizontal strips.

Run it on 2 (or 4) local worker processes:

    keras-comm-run -n 2 examples/halo_exchange_conv.py

Every worker sees the same images but keeps only its strip of rows of each
(worker 0 the top rows, worker 1 the bottom rows, ...). Before each 3x3
convolution, `keras_comm.layers.HaloExchange` pads the strip with one
row from each neighbouring strip (the "halo") and zeros where there is no
neighbour, so a "valid" convolution of the padded strip is exactly the
strip's part of a "same" convolution of the whole image. The global average
pool sums the strips' pooled features with `keras_comm.layers.AllReduce`.
The backward pass is exact: halo gradients are sent back to the strip they
came from, so every worker's copy of the kernels receives the gradient of
the whole-image loss.

The chief then trains the ordinary whole-image CNN (Conv2D padding="same",
same initial weights, same batches) in one process and prints both test
accuracies.

The training loop is hand-written (`strategy.run` over a GradientTape
step): every worker is given the whole batch and `OwnStrip` keeps its rows,
which `fit`'s data-parallel split of each batch cannot express.
"""

import time

import _common

IMAGE_ROWS = 8


def parse_args(argv=None):
    p = _common.parser(__doc__, epochs=20, batch_size=32, learning_rate=0.02)
    p.add_argument("--filters", type=int, default=16, help="filters of the first convolution (the second has twice as many)")
    return _common.parse(p, argv, positive=("epochs", "batch_size", "filters"))


def layers_module():
    """Defines the one layer this example needs (keeps keras imports lazy)."""
    import keras
    import tensorflow as tf

    import keras_comm

    @keras.saving.register_keras_serializable(package="examples")
    class OwnStrip(keras.layers.Layer):
        """Keeps this replica's strip of rows: rows [r*h/n, (r+1)*h/n) of n strips."""

        def __init__(self, strips, **kwargs):
            super().__init__(**kwargs)
            self.strips = strips

        def call(self, images):
            rows = images.shape[1] // self.strips
            # Keras builds the model once for shapes outside any replica
            # (cross-replica context): any strip has the right shape then.
            r = 0 if tf.distribute.in_cross_replica_context() else keras_comm.rank()
            return images[:, r * rows:(r + 1) * rows]

        def compute_output_shape(self, input_shape):
            return (input_shape[0], input_shape[1] // self.strips, *input_shape[2:])


        def get_config(self):
            return {**super().get_config(), "strips": self.strips}

    return OwnStrip


def build_whole_image_model(filters, seed):
    """The ordinary single-process CNN."""
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((IMAGE_ROWS, 8, 1)),
            keras.layers.Conv2D(filters, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(2 * filters, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )
    return model


def build_strip_model(filters, strips):
    """The same CNN, each replica computing its strip of every feature map."""
    import keras

    import keras_comm.layers  # also binds keras_comm.ops

    halo = dict(
        # One row of each neighbour's strip above and below (a 3x3 kernel's
        # reach); nothing to the left and right (zeros = "same" padding).
        send_rank_ids=keras_comm.ops.halo_rank_ids(strips, 1),
        recv_rank_ids=keras_comm.ops.halo_rank_ids(strips, 1),
        send_lens=[1, 1, 1, 1],
        recv_lens=[1, 1, 1, 1],
        data_format="NHWC",
    )
    own_strip = layers_module()
    model = keras.Sequential(
        [
            keras.Input((IMAGE_ROWS, 8, 1)),
            own_strip(strips),
            keras_comm.layers.HaloExchange(**halo),
            keras.layers.Conv2D(filters, 3, padding="valid", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras_comm.layers.HaloExchange(**halo),
            keras.layers.Conv2D(2 * filters, 3, padding="valid", activation="relu"),
            # Mean over the strip, summed over the strips, / strips = the
            # mean over the whole feature map (the strips are equal in size).
            keras.layers.GlobalAveragePooling2D(),
            keras_comm.layers.AllReduce("sum"),
            keras.layers.Rescaling(1.0 / strips),
            keras.layers.Dense(10),
        ]
    )
    return model


def make_optimizer(learning_rate):
    import keras

    # Each step's gradient equals the whole-image gradient to float32
    # round-off (checked in main); over hundreds of steps ReLU and max-pool
    # kinks can magnify that round-off, more so with Adam, which divides by
    # the root of the gradient's second moment. SGD with momentum at this
    # rate keeps the runs close.
    return keras.optimizers.SGD(learning_rate, momentum=0.9)


def cross_entropy(labels, logits):
    import keras

    return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))


def accuracy(labels, logits):
    import keras

    return keras.ops.mean(keras.ops.cast(keras.ops.argmax(logits, -1) == labels, "float32"))


def batches(x, y, batch_size):
    """The same global batches, in the same order, for every worker and the reference."""
    for i in range(0, len(x), batch_size):
        yield x[i:i + batch_size], y[i:i + batch_size]


def train_strips(model, optimizer, strategy, args, x, y):
    """A hand-written training loop: every replica gets the whole batch."""
    import tensorflow as tf

    n = strategy.num_replicas_in_sync

    def replica_step(images, labels):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            # The logits (after the AllReduce) and so the loss are the same
            # on every replica; the objective is the SUM of the replicas'
            # losses, so each contributes 1/n of it.
            loss = cross_entropy(labels, logits) / n
        grads = tape.gradient(loss, model.trainable_variables)
        # Sums the replicas' gradients, then updates the mirrored weights.
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss * n

    step = tf.function(lambda images, labels: strategy.run(replica_step, args=(images, labels)))
    for epoch in range(args.epochs):
        losses = [float(strategy.experimental_local_results(step(xb, yb))[0]) for xb, yb in batches(x, y, args.batch_size)]
        yield epoch, sum(losses) / len(losses)


def evaluate_strips(model, strategy, x, y):
    import tensorflow as tf

    logits = tf.function(lambda images: strategy.run(lambda t: model(t, training=False), args=(images,)))(x)
    return float(accuracy(y, strategy.experimental_local_results(logits)[0]))


def first_batch_gradients(model, reference, strategy, x, y):
    """Max relative difference of the strip model's gradient (summed over
    replicas) and the whole-image model's, on one batch, same weights."""
    import tensorflow as tf

    n = strategy.num_replicas_in_sync

    def replica_grads(images, labels):
        with tf.GradientTape() as tape:
            loss = cross_entropy(labels, model(images, training=True)) / n
        grads = tape.gradient(loss, model.trainable_variables)
        return tf.distribute.get_replica_context().all_reduce("sum", grads)

    grads = tf.function(lambda a, b: strategy.run(replica_grads, args=(a, b)))(x, y)
    grads = [strategy.experimental_local_results(g)[0].numpy() for g in grads]
    with tf.GradientTape() as tape:
        loss = cross_entropy(y, reference(x, training=True))
    want = [g.numpy() for g in tape.gradient(loss, reference.trainable_variables)]
    return _common.max_rel_diff(grads, want)


def train_whole(model, optimizer, args, x, y):
    import tensorflow as tf

    @tf.function
    def step(images, labels):
        with tf.GradientTape() as tape:
            loss = cross_entropy(labels, model(images, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for _ in range(args.epochs):
        for xb, yb in batches(x, y, args.batch_size):
            step(xb, yb)


def main(argv=None):
    args = parse_args(argv)
    _common.quiet_tensorflow()
    import tensorflow as tf

    import keras_comm  # noqa: F401

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    n = strategy.num_replicas_in_sync
    chief = _common.chief_rank(strategy) == 0
    # Each strip must keep >= 1 row after the 2x2 pooling, and pool cleanly.
    if (IMAGE_ROWS // 2) % n:
        raise SystemExit(f"halo_exchange_conv.py runs on 1, 2 or 4 replicas. Received: {n} replicas")
    x_train, x_test, y_train, y_test = _common.load_digits(args.seed, images=True, train_samples=args.train_samples)

    reference = build_whole_image_model(args.filters, args.seed)
    initial_weights = reference.get_weights()
    with strategy.scope():
        model = build_strip_model(args.filters, n)
        model.set_weights(initial_weights)
        optimizer = make_optimizer(args.learning_rate)
    # Exactness witness: one batch's gradient against the whole-image model.
    grad_diff = first_batch_gradients(model, reference, strategy, x_train[: args.batch_size], y_train[: args.batch_size])
    if chief:
        print(f"first batch: max relative gradient difference vs the whole-image model {grad_diff:.2e}", flush=True)
        print(
            f"Training on {len(x_train)} digits split into {n} strips of "
            f"{IMAGE_ROWS // n} rows, batch {args.batch_size}.",
            flush=True,
        )
    start = time.time()
    for epoch, loss in train_strips(model, optimizer, strategy, args, x_train, y_train):
        if chief:
            print(f"epoch {epoch + 1}/{args.epochs} - loss {loss:.4f}", flush=True)
    seconds = time.time() - start
    results = {"replicas": n, "accuracy": evaluate_strips(model, strategy, x_test, y_test), "seconds": seconds,
               "first_batch_grad_rel_diff": grad_diff}

    if chief and not args.no_reference:
        train_whole(reference, make_optimizer(args.learning_rate), args, x_train, y_train)
        results["single_process_accuracy"] = float(accuracy(y_test, reference(x_test, training=False)))
        results["max_weight_rel_diff"] = _common.max_rel_diff(model.get_weights(), reference.get_weights())
    _common.report(args, "accuracy", results, chief)
    return _common.finish(strategy)


if __name__ == "__main__":
    raise SystemExit(main())
