"""`ParallelOptimizer`: gradient accumulation and optimizer-state sharding for `fit`."""

import enum
import logging
import weakref

import keras
import tensorflow as tf

from keras_comm import _validation
from keras_comm import topology
from keras_comm.parallel import fully_sharded
from keras_comm.training import accumulate
from keras_comm.training import optimizer_shards
from keras_comm.training import accumulate_plan
from keras_comm.training import step
from keras_comm.variables import annotations

logger = logging.getLogger("keras_comm")

# One accumulate/shard step (and its sharded state) per model, so that a
# second `fit` -- with the same or a new callback -- continues from the same
# optimizer state.
_ENGINES = weakref.WeakKeyDictionary()
# The callback serving each model's running `fit`, for `prepare_checkpoint`.
_ACTIVE = weakref.WeakKeyDictionary()


def prepare_checkpoint(model):
    """Whether a save made now captures `model`'s whole training state.

    For callbacks that save mid-epoch (`keras_comm.callbacks.BackupAndRestore`
    with an integer `save_freq`). Every worker must call it at the same step
    (and then save: the sharded optimizer state is all-gathered while the
    file is written, one variable at a time).

    Args:
        model: a Keras model.

    Returns:
        True when a save now captures the whole training state (always, unless
        a `ParallelOptimizer` is serving `model.fit`); False while that
        callback holds accumulated micro-batches not yet applied -- they live
        only in per-replica buffers, so the caller should save at a later
        step.
    """
    callback = _ACTIVE.get(model)
    if callback is None:
        return True
    return callback._prepare_checkpoint()


class ZeroStage(enum.IntEnum):
    """What is sharded over the replicas (ZeRO, Rajbhandari et al. 2020)."""

    #: Nothing: plain data parallel, one all-reduce per update.
    NONE = 0
    #: Optimizer state (slots and the float32 master weights).
    OPTIMIZER = 1
    #: Optimizer state and the gradient accumulation buffers.
    GRADIENTS = 2


def _format_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0


class ParallelOptimizer(keras.callbacks.Callback):
    """Gradient accumulation and ZeRO optimizer-state sharding for `model.fit`.

    Adding the callback is all it takes; it works with any Keras optimizer
    (SGD, Adam, AdamW, ...), with `LossScaleOptimizer` (mixed precision), and
    across several `fit` calls on the same model (the sharded state is kept
    per model). Without a strategy it trains as one replica.

    How a step runs: `fit` calls the model's train function once per
    micro-batch; this callback replaces it, for the duration of `fit`, with a
    host-side dispatcher over two compiled step functions -- "accumulate
    locally" and "accumulate, reduce, apply" -- so no collective ever sits
    inside a `tf.cond` (keras-team/keras#20582).

    Semantics: each micro-batch's gradient is the gradient of that global
    micro-batch's loss (as in plain `fit`). Every `accumulation_steps`
    micro-batches the optimizer takes one step with their mean (`mean=True`)
    or sum. At the end of an epoch whose length is not a multiple of
    `accumulation_steps`, the k pending micro-batches are applied as one step
    with the mean over those k (a window never spans two epochs), so with
    equally sized micro-batches `fit` matches plain training with batch
    ``accumulation_steps x micro-batch`` including the epoch's last, smaller
    batch. When the epoch length is unknown the pending window is applied in
    `on_epoch_end`.

    Collectives: zero_stage 0 all-reduces the accumulated gradient once per
    update. zero_stage 1 reduce-scatters it (flattened, each variable padded
    to a multiple of the replica count), updates this replica's 1/N shard of
    the weights with its 1/N share of the optimizer state, and all-gathers
    the weights: the bytes of one all-reduce. zero_stage 2 also shards the
    accumulation buffer, so it reduce-scatters every micro-step.

    Gradients are reduced here and only here, each exactly once: the model's
    own `train_step` and `optimizer.apply_gradients` are not called, and a
    variable that carries its own reduction (`keras_comm.training.reduction`:
    sharded weights of `keras_comm.parallel`, or a weight marked with
    `keras_comm.compat.mark_gradient_reduced` because a comm layer such as
    `MirrorOperator` already reduced its gradient) is reduced by its hook
    instead of the world-wide sum and updated unsharded. The steps themselves
    are `keras_comm.training.accumulate`'s, compiled by
    `keras_comm.training.step`. An unmarked weight
    behind a `MirrorOperator` would be summed twice (N times too large).

    Memory and checkpoints: the optimizer state lives in this callback's
    slots (1/N of each slot for zero_stage >= 1, whole for 0). From the first
    step of `fit` on, the optimizer's own full-size slot variables are
    released (they keep their names and shapes for Keras, but hold no
    memory; reading them gives empty arrays) and stay so after `fit`: the
    callback's state is the optimizer state. `save_weights`,
    `ModelCheckpoint` and `BackupAndRestore` still write standard Keras
    files: the save all-gathers each slot's shards while writing it (one
    variable at a time, so the transient is one variable's slot; every
    worker must save). A load cuts each replica's shard out of the file, also
    with a different number of workers. The float32 master copy of the
    weights is filled at each update and released after it. To train the
    model with plain `fit` afterwards, load a checkpoint into a new model.

    Args:
        accumulation_steps: micro-batches per optimizer step, an int >= 1.
        zero_stage: 0, 1 or 2 (or a `ZeroStage`).
        mean: average the accumulated micro-batch gradients (True) or sum
            them (False).
        dump_local_norm: add each trainable variable's local (this replica's,
            not reduced) gradient norm of the last micro-batch to the batch
            logs as ``local_grad_norm/<variable path>``.

    Raises:
        ValueError: for an invalid argument, or (at train begin) a strategy,
            optimizer option or `steps_per_execution` it cannot serve.

    Example:

    ```python
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build_and_compile()
    po = keras_comm.callbacks.ParallelOptimizer(accumulation_steps=4, zero_stage=1)
    model.fit(ds, epochs=3, callbacks=[po])
    po.state_bytes()  # bytes this replica holds for the optimizer
    ```
    """

    def __init__(
        self, accumulation_steps=1, zero_stage=0, mean=True, dump_local_norm=False
    ):
        super().__init__()
        accumulation_steps = _validation.accumulation_steps(accumulation_steps)
        try:
            if isinstance(zero_stage, bool):
                raise ValueError
            zero_stage = ZeroStage(zero_stage)
        except ValueError:
            raise ValueError(
                "`zero_stage` must be one of 0 (data parallel), 1 (shard "
                "optimizer state) or 2 (also shard gradient accumulation). "
                f"Received: zero_stage={zero_stage!r}"
            ) from None
        if not isinstance(mean, bool):
            raise ValueError(f"`mean` must be a bool. Received: mean={mean!r}")
        if not isinstance(dump_local_norm, bool):
            raise ValueError(
                f"`dump_local_norm` must be a bool. Received: dump_local_norm={dump_local_norm!r}"
            )
        self.accumulation_steps = accumulation_steps
        self.zero_stage = zero_stage
        self.mean = mean
        self.dump_local_norm = dump_local_norm
        self._engine = None
        self._windowed = ()
        self._original_train_function = None
        self._functions = None
        self._pending = 0
        self._step_in_epoch = 0
        self._needs_reshard = False
        self.counts = {"micro_steps": 0, "updates": 0}

    def get_config(self):
        return {
            "accumulation_steps": self.accumulation_steps,
            "zero_stage": int(self.zero_stage),
            "mean": self.mean,
            "dump_local_norm": self.dump_local_norm,
        }

    # --- state ------------------------------------------------------------

    def state_bytes(self, breakdown=False):
        """Bytes this replica holds for the optimizer (beyond the model's weights).

        Every tensor the callback and the optimizer keep: the optimizer slots
        (this replica's shards, plus any of the optimizer's own slots still
        holding memory -- those of variables with their own gradient
        reduction), the float32 master weights (held only while an update
        runs) and the gradient accumulation buffers. Scalars (step counters,
        learning rate, loss scale) are left out.

        Args:
            breakdown: return a dict ``{"optimizer", "master", "accumulation"}``
                instead of the total.

        Raises:
            ValueError: before the callback has served a `fit`.
        """
        if self._engine is None:
            raise ValueError(
                "`state_bytes()` is known once `fit` has started with this "
                "callback. Received: state_bytes() before fit"
            )
        parts = self._engine.state.nbytes()
        return parts if breakdown else sum(parts.values())

    def unsharded_state_bytes(self):
        """Bytes the same state takes unsharded (zero_stage 0), per replica.

        Same breakdown keys as `state_bytes(breakdown=True)`.
        """
        parts = self.state_bytes(breakdown=True)
        layout = self._engine.state.layout
        full, shard = sum(layout.sizes), layout.shard_total
        itemsize = 4  # every tensor the callback holds is float32
        return {
            # (shard is 0 when every weight has its own reduction: FullyShard)
            "optimizer": parts["optimizer"] // (shard * itemsize) * full * itemsize if shard else 0,
            "master": full * itemsize,
            "accumulation": full * itemsize if parts["accumulation"] else 0,
        }

    # --- validation -------------------------------------------------------

    def _validate(self, model):
        strategy = model.distribute_strategy
        supported = (
            isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            or not tf.distribute.has_strategy()
            and strategy.num_replicas_in_sync == 1
        )
        if not supported:
            raise ValueError(
                "ParallelOptimizer runs under tf.distribute.MultiWorkerMirroredStrategy "
                "or without a strategy. "
                f"Received: strategy={type(strategy).__name__}"
            )
        if model.steps_per_execution != 1:
            raise ValueError(
                "ParallelOptimizer dispatches one micro-batch per train-function "
                "call and needs `steps_per_execution=1` in `compile`. "
                f"Received: steps_per_execution={model.steps_per_execution}"
            )
        if model.run_eagerly and strategy.num_replicas_in_sync > 1:
            raise ValueError(
                "ParallelOptimizer needs compiled steps with several replicas. "
                "Received: run_eagerly=True"
            )
        if model.optimizer is None:
            raise ValueError("ParallelOptimizer needs a compiled model. Received: optimizer=None")
        _, inner = optimizer_shards.user_optimizers(model.optimizer)
        if getattr(inner, "gradient_accumulation_steps", None):
            raise ValueError(
                "Use ParallelOptimizer(accumulation_steps=...) instead of the "
                "optimizer's own gradient accumulation, which fails under "
                "tf.distribute (keras-team/keras#20582). Received: "
                f"gradient_accumulation_steps={inner.gradient_accumulation_steps}"
            )
        if inner.use_ema:
            raise ValueError(
                "ParallelOptimizer does not support optimizer EMA. Received: use_ema=True"
            )
        hooked = any(annotations.gradient_hook(v) is not None for v in model.trainable_variables)
        if (self.zero_stage >= 1 or hooked) and strategy.num_replicas_in_sync > 1:
            for name in ("clipnorm", "global_clipnorm"):
                if getattr(inner, name, None):
                    raise ValueError(
                        f"`{name}` needs whole gradients; with zero_stage >= 1 "
                        "(or sharded weights) each replica holds a shard. Use "
                        f"clipvalue or zero_stage=0. Received: {name}={getattr(inner, name)}"
                    )

    def _local_accumulation_layers(self, model):
        """`FullyShard` layers with accumulation="local": each reduce-scatters
        on its own every k-th backward, so this callback's updates must fall
        on those backwards (checked here, before the first step)."""
        layers = [
            layer
            for layer in fully_sharded.fully_sharded_layers(model)
            if layer.accumulation is fully_sharded.Accumulation.LOCAL and layer.accumulation_steps > 1
        ]
        steps = self.params.get("steps") if self.params else None
        for layer in layers:
            k = layer.accumulation_steps
            prefix = (
                f"FullyShard {layer.name!r}: accumulation='local' with "
                f"accumulation_steps={k} reduce-scatters once every {k} backward passes, so"
            )
            if self.accumulation_steps != k:
                raise ValueError(
                    f"{prefix} `accumulation_steps` must equal ParallelOptimizer's. "
                    f"Received: accumulation_steps={k}, "
                    f"ParallelOptimizer(accumulation_steps={self.accumulation_steps})"
                )
            # An epoch's last, partial window is applied early (and, when the
            # epoch's length is unknown, flushed without a backward): either
            # would be out of step with the layer.
            if steps is None or int(steps) % k:
                raise ValueError(
                    f"{prefix} each epoch's number of batches must be a known "
                    f"multiple of {k} (ParallelOptimizer applies an epoch's last, "
                    "partial window early, out of step with the layer; use "
                    "steps_per_epoch, drop the remainder, or accumulation="
                    f"'sharded'). Received: batches per epoch={steps}"
                )
        return layers

    # --- fit hooks --------------------------------------------------------

    def on_train_begin(self, logs=None):
        model = self.model
        self._validate(model)
        self._windowed = self._local_accumulation_layers(model)
        for layer in self._windowed:
            layer.set_accumulation_window(self.accumulation_steps)
        engine = _ENGINES.get(model)
        if engine is None or not engine.matches(
            model, self.zero_stage, self.accumulation_steps, self.dump_local_norm
        ):
            if engine is not None and engine.external is not None:
                # The old state owns the optimizer's slots: hand them back
                # (full size, for the new state to cut its shards from).
                engine.external.restore_user_slots()
            engine = accumulate.AccumulateStep(
                model, int(self.zero_stage), self.accumulation_steps, self.dump_local_norm
            )
            _ENGINES[model] = engine
        self._engine = engine
        strategy = model.distribute_strategy
        accumulating = self.accumulation_steps > 1
        self._functions = {
            "micro": step.make_function(model, engine.micro_step) if accumulating else None,
            "apply": step.make_function(model, engine.apply_step),
            "flush": (
                step.compile_replica_call(
                    strategy, engine.flush_step, "ParallelOptimizer's flush step"
                )
                if accumulating
                else None
            ),
        }
        self._original_train_function = model.train_function
        model.train_function = self._train_function
        self._pending = 0
        # Deferred to the first step: a restoring callback (BackupAndRestore)
        # may load the optimizer's slots after this callback's train begin.
        self._needs_reshard = True
        _ACTIVE[model] = self
        if topology.is_chief(strategy):
            parts = self.state_bytes(breakdown=True)
            full = self.unsharded_state_bytes()
            logger.info(
                "optimizer state per replica: %s (1/%d of %s); float32 master "
                "weights while an update runs: %s; gradient accumulation "
                "buffers: %s (%s); in all %s",
                _format_bytes(parts["optimizer"]),
                engine.state.num_shards,
                _format_bytes(full["optimizer"]),
                _format_bytes(parts["master"]),
                _format_bytes(parts["accumulation"]),
                "sharded" if self.zero_stage == 2 else "not sharded",
                _format_bytes(sum(parts.values())),
            )

    def on_epoch_begin(self, epoch, logs=None):
        self._step_in_epoch = 0

    def on_train_batch_begin(self, batch, logs=None):
        # Keras's own step index: right also when a resumed fit skips the
        # epoch's first steps without calling the train function.
        self._step_in_epoch = batch

    def _train_function(self, iterator):
        if self._needs_reshard:
            # Deferred to here: a restoring callback may load the optimizer's
            # slots after this callback's train begin.
            self._take_slots()
            self._needs_reshard = False
        steps = self.params.get("steps") if self.params else None
        if self._functions["micro"] is None or accumulate_plan.is_apply_step(
            self._pending, self.accumulation_steps, self._step_in_epoch, steps
        ):
            self._engine.state.set_scale(
                accumulate_plan.accumulation_scale(self._pending + 1, self.mean)
            )
            logs = self._functions["apply"](iterator)
            self._pending = 0
            self.counts["updates"] += 1
        else:
            logs = self._functions["micro"](iterator)
            self._pending += 1
        self.counts["micro_steps"] += 1
        if self.dump_local_norm:
            logs = dict(logs)
            logs.update(self._engine.state.local_norms())
        return logs

    def on_epoch_end(self, epoch, logs=None):
        # Only reached with pending micro-batches when the epoch length is
        # unknown (otherwise its last step applied them).
        self._flush()
        self._sync()  # for savers at the epoch end

    def _take_slots(self):
        """The callback's slots become the optimizer state (first step of a fit)."""
        state = self._engine.state
        if not state.owns_slots:
            self._engine.take_user_slots()
        if self._engine.external is None:
            self._engine.external = accumulate.ExternalSlots(self._engine)
        store = self._engine.external
        for opt in optimizer_shards.user_optimizers(self.model.optimizer):
            if opt is not None:
                annotations.register_external_slots(opt, store)

    def _flush(self):
        if self._pending and self._functions and self._functions["flush"] is not None:
            self._engine.state.set_scale(accumulate_plan.accumulation_scale(self._pending, self.mean))
            self._functions["flush"]()
            self._pending = 0
            self.counts["updates"] += 1

    def _prepare_checkpoint(self):
        if self._pending:
            return False
        self._sync()
        return True

    def _sync(self):
        if self._engine is not None and self._engine.state.owns_slots:
            self._engine.sync_hooked_slots()

    def on_train_end(self, logs=None):
        self._flush()
        self._sync()
        if self.model is not None and self._functions is not None:
            self.model.train_function = self._original_train_function
        if self.model is not None and _ACTIVE.get(self.model) is self:
            del _ACTIVE[self.model]
        for layer in self._windowed:
            layer.set_accumulation_window(None)
        self._windowed = ()
        self._functions = None
