"""Data parallelism by hand: a GradientTape loop with MirrorOperator and AllReduce.

Run it on 2 local worker processes:

    keras-comm-run -n 2 examples/custom_training_loop.py

What `fit` does for you, written out with keras_comm's ops and layers:

* each worker reads its share of every global batch
  (`strategy.experimental_distribute_dataset`);
* `keras_comm.ops.all_reduce` counts the samples of the global batch, so
  the loss is the global mean even for the last, smaller batch (each
  replica's loss is its sum divided by the GLOBAL count: the objective, the
  sum of the replicas' losses, is then the global mean);
* every weight goes through a `keras_comm.layers.MirrorOperator` before the
  model uses it (`model.stateless_call`): forward it is the identity,
  backward it sums the weight's gradient over the replicas. So the gradient
  the tape returns is already the global one, and
  `keras_comm.compat.mark_gradient_reduced` tells the optimizer not to sum
  it a second time;
* the training accuracy shown is the global one, from one `all_reduce` of
  [correct, count] pairs.

The chief then trains the same model with the same loop in one process (a
world of one: every keras_comm op is the identity) and prints both test
accuracies.
"""

import time

import _common


def parse_args(argv=None):
    p = _common.parser(__doc__, epochs=15, batch_size=64, learning_rate=3e-3)
    p.add_argument("--hidden", type=int, default=64, help="hidden units")
    return _common.parse(p, argv, positive=("epochs", "batch_size", "hidden"))


def build_model(hidden, seed):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(10)]
    )


def make_trainer(model, learning_rate):
    """Returns ``replica_step(images, labels) -> [loss sum, correct, count]``.

    Call it in replica context (inside `strategy.run`), or directly without
    a strategy.
    """
    import keras
    import tensorflow as tf

    import keras_comm.compat
    import keras_comm.layers
    import keras_comm.ops

    optimizer = keras.optimizers.Adam(learning_rate)
    # Backward: the gradient summed over all replicas (mean=False: the
    # exact adjoint for the sum-of-losses objective). fusion=1: the weights'
    # gradients travel in one all-reduce (inside the fusion scope below).
    mirror = keras_comm.layers.MirrorOperator(mean=False, fusion=1)
    for variable in model.trainable_variables:
        keras_comm.compat.mark_gradient_reduced(variable)

    def replica_step(images, labels):
        local_count = tf.cast(tf.shape(labels)[0], "float32")
        global_count = keras_comm.ops.all_reduce(local_count)
        with keras_comm.ops.fusion_scope():
            with tf.GradientTape() as tape:
                weights = [mirror(v) for v in model.trainable_variables]
                logits, _ = model.stateless_call(
                    weights, model.non_trainable_variables, images, training=True
                )
                losses = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
                loss = tf.reduce_sum(losses) / global_count
            grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        correct = tf.reduce_sum(tf.cast(tf.argmax(logits, -1, output_type="int32") == labels, "float32"))
        # One transfer for the three numbers: the global loss and accuracy.
        return keras_comm.ops.all_reduce(tf.stack([loss * global_count, correct, local_count]))

    return replica_step


def train(model, strategy, args, x, y):
    """Yields (epoch, global loss, global accuracy)."""
    import tensorflow as tf

    import keras_comm.watchdog

    with strategy.scope():
        replica_step = make_trainer(model, args.learning_rate)
    dataset = strategy.experimental_distribute_dataset(_common.global_batches(x, y, args.batch_size))
    step = tf.function(lambda images, labels: strategy.run(replica_step, args=(images, labels)))
    for epoch in range(args.epochs):
        totals = 0.0
        for images, labels in dataset:
            # keras_comm's timeout for the step, by one watchdog thread (what
            # fit does per step); unguarded, every collective would start
            # TensorFlow's per-op timeout threads.
            with keras_comm.watchdog.guard("the custom train step"):
                totals += strategy.experimental_local_results(step(images, labels))[0].numpy()
        loss_sum, correct, count = totals
        yield epoch, loss_sum / count, correct / count


def test_accuracy(model, x, y):
    import numpy as np

    return float(np.mean(np.argmax(model.predict(x, verbose=0), -1) == y))


def main(argv=None):
    args = parse_args(argv)
    _common.quiet_tensorflow()
    import tensorflow as tf

    import keras_comm  # noqa: F401

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    chief = _common.chief_rank(strategy) == 0
    x_train, x_test, y_train, y_test = _common.load_digits(args.seed, train_samples=args.train_samples)

    with strategy.scope():
        model = build_model(args.hidden, args.seed)
    if chief:
        print(
            f"Training on {len(x_train)} digits with {strategy.num_replicas_in_sync} replicas, "
            f"global batch {args.batch_size}, in a hand-written loop.",
            flush=True,
        )
    start = time.time()
    for epoch, loss, acc in train(model, strategy, args, x_train, y_train):
        if chief:
            print(f"epoch {epoch + 1}/{args.epochs} - loss {loss:.4f} - accuracy {acc:.4f}", flush=True)
    seconds = time.time() - start
    results = {
        "replicas": strategy.num_replicas_in_sync,
        "accuracy": test_accuracy(model, x_test, y_test),
        "seconds": seconds,
    }

    if chief and not args.no_reference:
        # Same loop, no cluster: one replica in the default strategy.
        single = build_model(args.hidden, args.seed)
        for _ in train(single, tf.distribute.get_strategy(), args, x_train, y_train):
            pass
        results["single_process_accuracy"] = test_accuracy(single, x_test, y_test)
        results["max_weight_rel_diff"] = _common.max_rel_diff(model.get_weights(), single.get_weights())
    _common.report(args, "accuracy", results, chief)
    return _common.finish(strategy)


if __name__ == "__main__":
    raise SystemExit(main())
