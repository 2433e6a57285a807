"""Every private Keras attribute keras_comm touches, each behind a named function.

Why each is needed is in its docstring. Imports of ``keras.src`` happen
inside the functions: they run only once `keras_comm.compat` has accepted the
installed Keras version (see `keras_comm.compat.SUPPORTED_KERAS`).

`relied_on()` names the private functions keras_comm replaces, calls or
mirrors; tests/compat/test_private_api.py hashes their source per Keras version.
"""

import contextlib
import sys

import keras
import tensorflow as tf

# --- The TensorFlow trainer: the step owner installs itself here -------------

#: `TensorFlowTrainer` methods `keras_comm.compat` replaces.
TRAINER_METHODS = ("_maybe_symbolic_build", "_make_function", "train_step", "make_predict_function")
# Originals are stored on the patched module itself (not in keras_comm) so that
# re-importing or reloading keras_comm cannot mistake a patched function for
# an original one.
_ORIGINALS_ATTR = "_keras_comm_compat_originals"
_OPTIMIZER_ORIGINAL_ATTR = "_keras_comm_compat_all_reduce_sum_gradients"


def _trainer_module():
    from keras.src.backend.tensorflow import trainer

    return trainer


def trainer_class():
    """The TensorFlow backend's trainer class.

    Keras 3.16 renames `TensorFlowTrainer` to `Trainer` (and the base
    `trainers.trainer.Trainer` to `BaseTrainer`); the methods keras_comm
    replaces are unchanged by the rename.
    """
    module = _trainer_module()
    cls = getattr(module, "TensorFlowTrainer", None)
    return cls if cls is not None else module.Trainer


def _base_trainer_class():
    """The backend-independent trainer base class (`Trainer`; 3.16: `BaseTrainer`)."""
    from keras.src.trainers import trainer as base_trainer

    cls = getattr(base_trainer, "BaseTrainer", None)
    return cls if cls is not None else base_trainer.Trainer


def _optimizer_class():
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    return TFOptimizer


def tf_optimizer_class():
    """Keras's TensorFlow-backend optimizer base class (`keras.src` path).

    keras_comm.parallel's checkpointing replaces its public
    `save_own_variables` / `load_own_variables` so that optimizer slots of
    sharded weights are written full-size and read back as each replica's
    slice; only the class itself is private (it is not exported by Keras).
    """
    return _optimizer_class()


def trainer_patched():
    """Whether `install_trainer_methods` is in effect."""
    return hasattr(_trainer_module(), _ORIGINALS_ATTR)


def install_trainer_methods(replacements):
    """Replaces `TensorFlowTrainer` methods; the originals stay reachable.

    Needed because stock Keras cannot train under
    MultiWorkerMirroredStrategy (see `keras_comm.compat`): `fit`, `evaluate`
    and `predict` build and compile their steps through these private
    methods, and there is no public hook for a strategy-aware step.

    Args:
        replacements: ``{name: function}`` for every name in `TRAINER_METHODS`.
    """
    module = _trainer_module()
    cls = trainer_class()
    setattr(module, _ORIGINALS_ATTR, {n: cls.__dict__[n] for n in TRAINER_METHODS})
    for name in TRAINER_METHODS:
        setattr(cls, name, replacements[name])


def restore_trainer_methods():
    """Undoes `install_trainer_methods`; a no-op when not installed."""
    module = _trainer_module()
    originals = getattr(module, _ORIGINALS_ATTR, None)
    if originals is None:
        return
    cls = trainer_class()
    for name in TRAINER_METHODS:
        setattr(cls, name, originals[name])
    delattr(module, _ORIGINALS_ATTR)


#: `TensorFlowTrainer` methods `keras_comm.compat` wraps (upstream's code runs
#: inside the wrapper; `training.step.releasing_iterators`).
TRAINER_WRAPPED = ("fit", "evaluate")
_WRAPPED_ATTR = "_keras_comm_compat_wrapped"


def install_trainer_wrappers(wrap):
    """Replaces each `TRAINER_WRAPPED` method by ``wrap(upstream_method)``; idempotent.

    Needed because the iterators `fit` and `evaluate` create and drop are
    visible only inside those calls, and there is no public hook that runs
    when one returns or raises (callbacks' `on_train_end` does not run on
    an exception).
    """
    module = _trainer_module()
    if hasattr(module, _WRAPPED_ATTR):
        return
    cls = trainer_class()
    originals = {n: cls.__dict__[n] for n in TRAINER_WRAPPED}
    setattr(module, _WRAPPED_ATTR, originals)
    for name, method in originals.items():
        setattr(cls, name, wrap(method))


def restore_trainer_wrappers():
    """Undoes `install_trainer_wrappers`; a no-op when not installed."""
    module = _trainer_module()
    originals = getattr(module, _WRAPPED_ATTR, None)
    if originals is None:
        return
    cls = trainer_class()
    for name, method in originals.items():
        setattr(cls, name, method)
    delattr(module, _WRAPPED_ATTR)


def trainer_method(name):
    """Upstream's `TensorFlowTrainer.<name>` (the original while patched)."""
    module = _trainer_module()
    originals = getattr(module, _ORIGINALS_ATTR, None)
    if originals is not None:
        return originals[name]
    return trainer_class().__dict__[name]


def current_trainer_method(name):
    """What `TensorFlowTrainer.<name>` is right now (patched or not)."""
    return trainer_class().__dict__[name]


def install_gradient_reduction(replacement):
    """Replaces `TFOptimizer._all_reduce_sum_gradients`; idempotent.

    Needed so that a variable may carry its own gradient reduction (sharded
    weights reduce over their data-parallel group, weights a comm layer
    already reduced not at all): the optimizer reduces every gradient over
    the world in this private method, with no public per-variable hook.
    """
    cls = _optimizer_class()
    if not hasattr(cls, _OPTIMIZER_ORIGINAL_ATTR):
        setattr(cls, _OPTIMIZER_ORIGINAL_ATTR, cls.__dict__["_all_reduce_sum_gradients"])
        cls._all_reduce_sum_gradients = replacement


def restore_gradient_reduction():
    """Undoes `install_gradient_reduction`; a no-op when not installed."""
    cls = _optimizer_class()
    original = cls.__dict__.get(_OPTIMIZER_ORIGINAL_ATTR)
    if original is not None:
        cls._all_reduce_sum_gradients = original
        delattr(cls, _OPTIMIZER_ORIGINAL_ATTR)


def upstream_gradient_reduction():
    """Upstream's `TFOptimizer._all_reduce_sum_gradients` (the original while patched)."""
    cls = _optimizer_class()
    return cls.__dict__.get(_OPTIMIZER_ORIGINAL_ATTR, cls.__dict__["_all_reduce_sum_gradients"])


def current_gradient_reduction():
    """What `TFOptimizer._all_reduce_sum_gradients` is right now."""
    return _optimizer_class()._all_reduce_sum_gradients


# --- The epoch iterator: one tf.data iterator per epoch ----------------------

_EPOCH_ITERATOR_ORIGINAL_ATTR = "_keras_comm_original_enumerate_iterator"


def _epoch_iterator_classes():
    from keras.src.backend.tensorflow import trainer as tf_trainer
    from keras.src.trainers import epoch_iterator

    return epoch_iterator.EpochIterator, tf_trainer.TFEpochIterator


def upstream_enumerate_iterator():
    """Upstream's `EpochIterator._enumerate_iterator` (what TFEpochIterator inherits)."""
    return _epoch_iterator_classes()[0].__dict__["_enumerate_iterator"]


def install_epoch_iterator(choose):
    """Replaces `TFEpochIterator._enumerate_iterator` by a chooser; idempotent.

    Needed because upstream's generator, when `steps_per_epoch` is not given
    and the number of batches is known, creates a new iterator over the
    dataset as each epoch ends that the next epoch never uses (it creates its
    own), so every epoch of `fit` and every `evaluate` builds two tf.data
    iterators -- under MultiWorkerMirroredStrategy two multi-device iterators,
    and the spare one is destroyed on the host at the next epoch's first
    step. There is no public hook for how the epoch iterator enumerates.

    Args:
        choose: ``choose(epoch_iterator) -> bool``: whether this iterator
            enumerates with `enumerate_epoch_one_iterator` (else upstream's).
    """
    _, cls = _epoch_iterator_classes()
    if _EPOCH_ITERATOR_ORIGINAL_ATTR in cls.__dict__:
        return
    upstream = upstream_enumerate_iterator()

    def _enumerate_iterator(self):
        if choose(self):
            return enumerate_epoch_one_iterator(self)
        return upstream(self)

    setattr(cls, _EPOCH_ITERATOR_ORIGINAL_ATTR, upstream)
    cls._enumerate_iterator = _enumerate_iterator


def restore_epoch_iterator():
    """Undoes `install_epoch_iterator`; a no-op when not installed."""
    _, cls = _epoch_iterator_classes()
    if _EPOCH_ITERATOR_ORIGINAL_ATTR in cls.__dict__:
        del cls._enumerate_iterator
        delattr(cls, _EPOCH_ITERATOR_ORIGINAL_ATTR)


def epoch_iterator_installed():
    """Whether `install_epoch_iterator` is in effect."""
    return _EPOCH_ITERATOR_ORIGINAL_ATTR in _epoch_iterator_classes()[1].__dict__


def epoch_iterator_strategy(epoch_iterator):
    """The strategy a `TFEpochIterator` distributes its dataset with."""
    return epoch_iterator._distribute_strategy


def _yields_end_step():
    # Keras 3.11 added the last step of each execution to what it yields.
    return tuple(int(p) for p in keras.version().split(".")[:2]) >= (3, 11)


def enumerate_epoch_one_iterator(self):
    """Upstream's `EpochIterator._enumerate_iterator` without the spare iterator.

    Mirrors upstream line by line (hashed in `relied_on`). One difference:
    when `steps_per_epoch` is None and the number of batches is known,
    upstream ends the epoch with ``self._current_iterator =
    iter(self._get_iterator())``, an iterator the next epoch discards unused
    (its ``self.steps_per_epoch is None`` test creates another). Here the
    epoch ends with no current iterator, so the next epoch creates the one
    it uses, as it did, and no other. With `steps_per_epoch` given (where
    upstream does carry the iterator over) or an unknown number of batches
    (one iterator per epoch already), upstream's generator runs unchanged.
    """
    if self.steps_per_epoch or not self._num_batches:
        yield from upstream_enumerate_iterator()(self)
        return
    self.data_adapter.on_epoch_begin()
    steps_per_epoch = self._num_batches
    # Upstream's condition `self._current_iterator is None or
    # self.steps_per_epoch is None` holds: a fresh iterator every epoch.
    self._current_iterator = iter(self._get_iterator())
    self._steps_seen = 0
    for step in range(0, steps_per_epoch, self.steps_per_execution):
        if self._num_batches and self._steps_seen >= self._num_batches:
            break  # upstream warns only when `steps_per_epoch` was given
        self._steps_seen += self.steps_per_execution
        if _yields_end_step():
            yield (
                step,
                step + self.steps_per_execution - 1,
                self._current_iterator,
            )
        else:  # Keras 3.10: (step, iterator)
            yield step, self._current_iterator
    if self._num_batches and self._steps_seen >= self._num_batches:
        self._current_iterator = None  # upstream: a spare iterator here
        self._steps_seen = 0
    self.data_adapter.on_epoch_end()


# --- Callbacks: adapted to the strategy where `fit` builds its list -----------

_CALLBACK_LIST_ORIGINAL_ATTR = "_keras_comm_original_init"


def upstream_callback_list_init():
    """Upstream's `keras.callbacks.CallbackList.__init__` (the original while replaced)."""
    cls = keras.callbacks.CallbackList
    return cls.__dict__.get(_CALLBACK_LIST_ORIGINAL_ATTR, cls.__dict__["__init__"])


def install_callback_list_init(replacement):
    """Replaces `keras.callbacks.CallbackList.__init__`; idempotent.

    Needed because `fit`, `evaluate` and `predict` build their callback list
    inside (`CallbackList(callbacks, ..., model=self)`), with no hook to adapt
    Keras's file-writing callbacks to a multi-worker strategy before they see
    the model (`keras_comm.callbacks._keras_callbacks`). The class is public;
    the constructor's signature and what those callbacks read their paths
    from are relied on (hashed in `relied_on`).
    """
    cls = keras.callbacks.CallbackList
    if _CALLBACK_LIST_ORIGINAL_ATTR not in cls.__dict__:
        setattr(cls, _CALLBACK_LIST_ORIGINAL_ATTR, cls.__dict__["__init__"])
        cls.__init__ = replacement


def restore_callback_list_init():
    """Undoes `install_callback_list_init`; a no-op when not installed."""
    cls = keras.callbacks.CallbackList
    original = cls.__dict__.get(_CALLBACK_LIST_ORIGINAL_ATTR)
    if original is not None:
        cls.__init__ = original
        delattr(cls, _CALLBACK_LIST_ORIGINAL_ATTR)


def callback_list_init_installed():
    """Whether `install_callback_list_init` is in effect."""
    return _CALLBACK_LIST_ORIGINAL_ATTR in keras.callbacks.CallbackList.__dict__


# --- The model, inside a step ------------------------------------------------


def model_strategy(model):
    """The strategy `model` was created under, or None.

    Upstream's symbolic build tests this attribute (not the public
    `distribute_strategy`, which falls back to the current strategy), and
    so must its replacement.
    """
    return model._distribute_strategy


def call_has_training_arg(model):
    """Whether `model.call` takes `training`; the default step passes it if so."""
    return model._call_has_training_arg


def compute_loss(model, x, y, y_pred, sample_weight):
    """The model's total loss for one batch, as the default `train_step` computes it.

    Public `compute_loss` skips the `training` argument that tracks
    regularization losses the way upstream's step does.
    """
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
    )


def track_loss(model, loss, batch_size):
    """Updates the model's "loss" metric as the default `train_step` does.

    The tracker and the unscaling (undoing the 1/num_replicas factor Keras
    folds into the loss under a strategy) are both private.
    """
    from keras.src.losses import loss as loss_module

    model._loss_tracker.update_state(
        loss_module.unscale_loss_for_distribution(loss), sample_weight=batch_size
    )


def autoconvert_optionals(model, step):
    """`step` wrapped to receive None for empty `tf.experimental.Optional`s.

    Keras >= 3.12 passes optional inputs this way; earlier versions have no
    wrapper and `step` is returned unchanged.
    """
    wrap = getattr(model, "_autoconvert_optionals", None)
    return step if wrap is None else wrap(step)


def concat_replica_outputs(outputs, strategy):
    """The replicas' predictions of one batch, concatenated in input order.

    Upstream's predict step does this with the private `reduce_per_replica`
    (``reduction="concat"``): locally the replicas' results in order, across
    workers an all-gather of every replica's rows (of possibly different
    sizes) reordered to the input's order. keras_comm's predict step
    (`training.step.make_predict_function`) returns the same.
    """
    from keras.src.backend.tensorflow import trainer

    return trainer.reduce_per_replica(outputs, strategy, reduction="concat")


def symbolic_build(model, data_batch):
    """Builds `model`'s weights, metrics and optimizer from a batch's specs.

    The private step `fit` runs before its first step; keras_comm calls it
    with specs instead of a batch pulled from the iterator.
    """
    model._symbolic_build(data_batch=data_batch)


def iterator_element_spec(iterator):
    """The element spec of the dataset behind Keras's distributed-iterator wrapper."""
    return iterator._get_iterator().element_spec


def set_initial_epoch(model, epoch):
    """Makes a running `fit` continue from `epoch` (as Keras's own BackupAndRestore does)."""
    model._initial_epoch = epoch


def track_variable(layer, variable):
    """Makes `layer` own `variable` (saved, listed in its weights).

    `add_weight` cannot create an ON_READ, non-aggregated variable, which the
    mirror layers' per-replica accumulators are.
    """
    layer._track_variable(variable)


# --- Variables and optimizers ------------------------------------------------


def tf_variable(variable):
    """The TensorFlow variable behind a Keras variable (others returned as is).

    Not `.value`, which may return an autocast tensor inside a mixed-precision
    call: keras_comm needs the variable itself, to mark it (the optimizer
    receives tf.Variables) and to assign to it.
    """
    return variable._value if isinstance(variable, keras.Variable) else variable


def current_learning_rate(optimizer):
    """The learning rate `optimizer` applies at its current iteration.

    Public `learning_rate` is a variable or schedule; this resolves both,
    exactly as `apply_gradients` does.
    """
    return optimizer._get_current_learning_rate()


def learning_rate_variable(optimizer):
    """The optimizer variable holding its learning rate, or None (a schedule)."""
    lr = getattr(optimizer, "_learning_rate", None)
    return lr if isinstance(lr, keras.Variable) else None


def clip_gradients(optimizer, grads):
    """`optimizer`'s clipnorm / clipvalue / global_clipnorm applied to `grads`,
    as `apply_gradients` applies them."""
    return optimizer._clip_gradients(grads)


def uses_weight_decay(optimizer, variable):
    """Whether `optimizer` decays `variable` (its exclusion lists)."""
    return optimizer._use_weight_decay(variable)


# --- Layers under construction -------------------------------------------------


def in_symbolic_scope():
    """True while Keras infers output specs on placeholders (no data, no replica).

    Read from the loaded module only: if Keras never opened the scope, the
    module need not be imported.
    """
    scope = sys.modules.get("keras.src.backend.common.symbolic_scope")
    return scope is not None and scope.in_symbolic_scope()


def in_symbolic_build():
    """True while Keras traces layers for shapes outside any replica.

    Keras's symbolic build (before `fit`/`evaluate`'s first step), building
    a Functional model, `compute_output_spec` and `summary` call layers on
    placeholders in Keras's symbolic scope; under a strategy with several
    replicas that happens in cross-replica context, where there is no "this
    replica" and nothing may be communicated. keras_comm's collectives and
    parallel layers then return local stand-ins of the right shape and dtype
    (and use rank 0's group). The one detector for both tiers.

    Outside the symbolic scope, cross-replica context stays an error (a
    collective raises `RuntimeError` naming the fix): computing stand-ins
    there would return wrong values silently.
    """
    return (
        in_symbolic_scope()
        and not tf.executing_eagerly()
        and tf.distribute.has_strategy()
        and tf.distribute.in_cross_replica_context()
        and tf.distribute.get_strategy().num_replicas_in_sync > 1
    )


# --- keras.distribution on TensorFlow: variables created as their shards -----

_INITIALIZE_ORIGINAL_ATTR = "_keras_comm_original_initialize_with_initializer"


def install_variable_initialization(hook):
    """Lets `hook` create a Keras variable's storage (`keras_comm.distribution`).

    Keras's JAX backend consults `keras.distribution.distribution()` when a
    variable is initialised (`backend/jax/core.py`); the TensorFlow backend
    does not. ``hook(variable, initializer)`` runs first, in
    `Variable._initialize_with_initializer` (where the JAX backend asks for
    the layout); it returns None to let Keras create the variable as usual,
    or the `tf.Variable` to use as the variable's storage (a per-replica
    shard). The variable's shape stays the full shape Keras gave it.

    A variable created from a concrete value (``keras.Variable(array)``)
    calls ``hook(variable, None, shape)`` instead, which may only refuse.
    """
    cls = keras.Variable  # the backend's class: what `add_weight` instantiates
    if _INITIALIZE_ORIGINAL_ATTR in cls.__dict__:
        return
    original = cls._initialize_with_initializer
    original_initialize = cls._initialize

    def _initialize_with_initializer(self, initializer):
        storage = hook(self, initializer, tuple(self._shape))
        if storage is None:
            return original(self, initializer)
        original_initialize(self, storage)  # a tf.Variable is kept as the storage

    def _initialize(self, value):
        if not callable(value) and not isinstance(value, tf.Variable):
            hook(self, None, tuple(value.shape))
        return original_initialize(self, value)

    setattr(cls, _INITIALIZE_ORIGINAL_ATTR, (original, original_initialize))
    cls._initialize_with_initializer = _initialize_with_initializer
    cls._initialize = _initialize


def restore_variable_initialization():
    cls = keras.Variable
    originals = cls.__dict__.get(_INITIALIZE_ORIGINAL_ATTR)
    if originals is not None:
        # Defined on the TensorFlow backend's base class, not on this one.
        del cls._initialize_with_initializer, cls._initialize
        delattr(cls, _INITIALIZE_ORIGINAL_ATTR)


def variable_layout(variable):
    """The `TensorLayout` a Keras variable was created with (`layout=`), or None.

    The optimizer creates each slot with its weight's `_layout`
    (`add_variable_from_reference`), which is how slots follow their weight.
    """
    return getattr(variable, "_layout", None)


def set_variable_layout(variable, layout):
    """Records the layout a weight was created with, as the JAX backend does."""
    variable._layout = layout


def variable_dtype(variable):
    """The dtype a Keras variable stores (its `dtype` reads the autocast dtype)."""
    return variable._dtype


def autocast(variable, value):
    """`value` cast as Keras casts `variable`'s reads in the current autocast scope."""
    return variable._maybe_autocast(value)


def stateless_value(variable):
    """The value a `keras.StatelessScope` holds for `variable`, or None.

    Inside `stateless_call` and Keras's symbolic tracing the scope, not the
    variable, gives the value; a sharded variable's reads must honour it.
    """
    from keras.src.backend.common import stateless_scope

    if not stateless_scope.in_stateless_scope():
        return None
    return stateless_scope.get_stateless_scope().get_current_value(variable)


def in_stateless_scope():
    from keras.src.backend.common import stateless_scope

    return stateless_scope.in_stateless_scope()


def install_output_relayout():
    """Makes `Layer.__call__`'s output relayout a no-op on TensorFlow.

    `Layer.__call__` passes a layer's outputs to
    `keras.distribution.distribute_tensor` when the distribution has a layout
    for ``path + "/output"``; the TensorFlow backend's `distribution_lib`
    lacks `distribute_tensor`. keras_comm computes every layer's outputs
    whole on each replica, so an output layout changes nothing.
    """
    from keras.src.backend.tensorflow import distribution_lib

    if not hasattr(distribution_lib, "distribute_tensor"):
        distribution_lib.distribute_tensor = _keep_layout


def _keep_layout(tensor, layout):
    return tensor


_LAYER_CALL_ORIGINAL_ATTR = "_keras_comm_original_call"


def _split_layer_classes():
    """The layers whose `call` reads one kernel the split-compute hook handles."""
    return {
        "dense": keras.layers.Dense,
        "einsum_dense": keras.layers.EinsumDense,
        "embedding": keras.layers.Embedding,
    }


def install_split_compute(hook):
    """Lets `hook` compute a Dense / EinsumDense / Embedding call split.

    ``hook(kind, layer, inputs)`` runs first in the layer's `call` (kind is
    "dense", "einsum_dense" or "embedding"): it returns the layer's output,
    computed on this replica's block of the kernel, or None to run Keras's
    own `call` (which reads the whole kernel). `call` is the narrowest
    place that sees both the input and the kernel. Subclasses that call
    ``super().call(inputs)`` (KerasHub's `ReversibleEmbedding` lookup) pass
    through it; ones that replace `call` do not.
    """
    import functools

    for kind, cls in _split_layer_classes().items():
        if _LAYER_CALL_ORIGINAL_ATTR in cls.__dict__:
            continue
        original = cls.call

        def make(kind, original):
            @functools.wraps(original)
            def call(self, inputs, *args, **kwargs):
                out = hook(kind, self, inputs)
                if out is None:
                    return original(self, inputs, *args, **kwargs)
                return out

            return call

        setattr(cls, _LAYER_CALL_ORIGINAL_ATTR, original)
        cls.call = make(kind, original)


def restore_split_compute():
    for cls in _split_layer_classes().values():
        original = cls.__dict__.get(_LAYER_CALL_ORIGINAL_ATTR)
        if original is not None:
            cls.call = original
            delattr(cls, _LAYER_CALL_ORIGINAL_ATTR)


def upstream_layer_call(kind):
    """Keras's own `call` of a split-compute layer (before the hook)."""
    cls = _split_layer_classes()[kind]
    return cls.__dict__.get(_LAYER_CALL_ORIGINAL_ATTR, cls.call)


def plain_kernel(layer, kind):
    """The kernel variable `layer`'s call reads as is, or None.

    Dense / EinsumDense read `_kernel`, Embedding `_embeddings`, through a
    property that adds LoRA or unpacks a quantized kernel: a layer in
    either mode reads more than its variable, so None (its call is not
    split).
    """
    if getattr(layer, "lora_enabled", False) or layer.quantization_mode is not None:
        return None
    return getattr(layer, "_embeddings" if kind == "embedding" else "_kernel", None)


# --- Fully sharded layers: weights without storage, checkpoints by structure --


def keep_uninitialized(variables):
    """Stops Keras from ever allocating `variables` (created uninitialised).

    Variables created in a `keras.StatelessScope` are queued for
    initialisation when the next outermost stateless scope closes (even one
    `stateless_call` opens); `keras_comm.parallel.FullyShard` builds its
    inner layer that way and must keep its full-size weights unallocated.
    """
    from keras.src.backend.common import global_state

    ids = {id(v) for v in variables}
    queued = global_state.get_global_attribute("uninitialized_variables") or []
    global_state.set_global_attribute(
        "uninitialized_variables", [v for v in queued if id(v) not in ids]
    )


def is_uninitialized(variable):
    """True for a Keras variable that has no storage (see `keep_uninitialized`)."""
    return isinstance(variable, keras.Variable) and variable._value is None


def deferred_initializer(variable):
    """The initializer an uninitialised Keras variable will be created with.

    A variable created in a `keras.StatelessScope` holds no value (Keras
    defers it and keeps the initializer until `_deferred_initialize`).
    `keras_comm.parallel.Pipeline` builds its stages that way, so that no
    replica allocates every stage, and computes each stage's initial values
    from these initializers; `FullyShard` computes each replica's shard from
    it (seeded alike on every worker) instead of ever creating the full
    variable.
    """
    return variable._initializer


def own_weights(layer):
    """The weights `layer` created itself (not its sublayers'), in its order.

    `Layer.weights` lists a layer's own variables and then its sublayers';
    `fully_shard` on a model it shards in place wraps each layer that owns
    weights, so it needs the first part alone.
    """
    return list(layer._trainable_variables) + list(layer._non_trainable_variables)


def optimizer_references(optimizer):
    """The variables `optimizer` was built for (`BaseOptimizer.build`'s
    list, the weights its slots are named after); empty before it is built."""
    return list(getattr(optimizer, "_trainable_variables", []))


def sublayers(layer):
    """Every layer below `layer` (nested in any depth, each once), in
    Keras's own walk (`Layer._flatten_layers`): the same order on every
    worker."""
    return layer._flatten_layers(include_self=False, recursive=True)


_DEFERRING = []


def deferring_variables():
    """Whether a `deferred_variables` block is running."""
    return bool(_DEFERRING)


@contextlib.contextmanager
def deferred_variables():
    """Inside, Keras variables created from an initializer get no storage.

    Each keeps its shape, dtype and initializer, `_value` None (what a
    `keras.StatelessScope` makes, `is_uninitialized`), and is not queued for
    allocation. Variables created from a value (an optimizer's iteration
    count, which a KerasHub task's constructor makes by compiling) are
    created as usual, which a stateless scope refuses. Yields the list of
    the variables deferred, in creation order. Replaces
    `Variable._initialize_with_initializer` (keras_comm.distribution's
    hook included) while the block runs.
    """
    cls = keras.Variable
    installed = cls.__dict__.get("_initialize_with_initializer")
    made = []

    def defer(self, initializer):
        self._value = None
        self._initializer = initializer
        made.append(self)

    cls._initialize_with_initializer = defer
    _DEFERRING.append(made)
    try:
        yield made
    finally:
        _DEFERRING.pop()
        if installed is None:
            del cls._initialize_with_initializer
        else:
            cls._initialize_with_initializer = installed


def allocate(variables):
    """Allocates deferred Keras variables now, from their initializers."""
    for v in variables:
        if is_uninitialized(v):
            v._deferred_initialize()


def drop_storage(variables):
    """Frees the storage of built Keras variables and leaves them as if
    created in a `keras.StatelessScope` (shape, dtype and a zeros
    placeholder for shape tracing; `is_uninitialized` is then True).

    `fully_shard` on a model it shards in place keeps each wrapped layer as
    its `FullyShard`'s inner layer, which must hold no full-size weight.
    """
    for v in variables:
        v._value = None
        v._initializer = keras.initializers.Zeros()


def replace_layers(container, replacements):
    """Points every reference `container` holds to a layer in `replacements`
    (``{id(old): new}``) at the new layer, in place and in the same position.

    References are the container's tracked sublayers (`Layer._layers`, whose
    order gives `weights`' order), its attributes (lists, tuples and dicts of
    layers included) and, for a Functional model, the operations and nodes
    of its graph (`Function._operations`, `_operations_by_depth`,
    `_nodes_by_depth`). A KerasHub backbone reaches a layer both ways: its
    graph calls it and its task calls it as an attribute in `generate()`.
    """
    from keras.src.ops.function import Function

    def swap(x):
        return replacements.get(id(x), x)

    layers = getattr(container, "_layers", None)
    if layers is not None:
        layers[:] = [swap(x) for x in layers]
    for name, value in list(vars(container).items()):
        if name == "_layers":
            continue
        if id(value) in replacements:
            object.__setattr__(container, name, swap(value))
        elif isinstance(value, list):
            # Keras's TrackedList would track the new layer again (not
            # through list.__setitem__); TensorFlow's ListWrapper keeps its
            # items elsewhere and needs its own __setitem__.
            setitem = list.__setitem__ if type(value).__name__ == "TrackedList" else type(value).__setitem__
            for i, x in enumerate(list(value)):
                if id(x) in replacements:
                    setitem(value, i, swap(x))
        elif isinstance(value, tuple) and any(id(x) in replacements for x in value):
            object.__setattr__(container, name, tuple(swap(x) for x in value))
        elif isinstance(value, dict):
            for k, x in list(value.items()):
                if id(x) in replacements:
                    dict.__setitem__(value, k, swap(x))
    if isinstance(container, Function):
        container._operations[:] = [swap(x) for x in container._operations]
        for ops in container._operations_by_depth.values():
            ops[:] = [swap(x) for x in ops]
        for nodes in container._nodes_by_depth.values():
            for node in nodes:
                if id(node.operation) in replacements:
                    node.operation = swap(node.operation)


def share_nodes(old, new):
    """Gives `new` the graph nodes of `old`, whose place it takes
    (`replace_layers`): Keras finds a node's index in its operation's
    `_inbound_nodes`."""
    new._inbound_nodes = old._inbound_nodes
    new._outbound_nodes = old._outbound_nodes


def _saving_lib():
    from keras.src.saving import saving_lib

    return saving_lib


def weights_store_path(store):
    """The path inside the file of the layer `store` was made for.

    Keras's H5 weights store is one object repositioned per layer; a
    `FullyShard` writes its inner layer's sublayers below that path, so that
    the file has the unwrapped model's structure.
    """
    path = getattr(store, "_h5_entry_path", None)
    if path is None:
        raise TypeError(
            "FullyShard saves into Keras's H5 weights store (.keras, "
            f".weights.h5). Received: store of type {type(store).__name__}"
        )
    return path


def save_children(layer, store, path):
    """Saves `layer`'s sublayers' state below `path`, as Keras's
    `saving_lib._save_state` does after a layer's own variables.

    Keras 3.10-3.11 and 3.13-3.14 also descend into `set` attributes here;
    3.12 and 3.15 (and this mirror) do not.
    """
    lib = _saving_lib()
    visited = {id(layer)}
    for attr, child in lib._walk_saveable(layer):
        child_path = f"{path}/{attr}" if path else attr
        if isinstance(child, _keras_saveable()):
            lib._save_state(child, store, None, child_path, visited)
        elif isinstance(child, (list, dict, tuple)):
            lib._save_container_state(child, store, None, child_path, visited)


def load_children(layer, store, path):
    """Loads `layer`'s sublayers' state from below `path` (`save_children`'s inverse).

    Passes a set and a dict for the failures, as Keras's own loaders do, and
    raises the first failure: Keras 3.10 and 3.11's `_load_state` test
    membership in `failed_saveables` unconditionally (None is a TypeError
    there), and with a set it records a failing saveable instead of raising.
    """
    lib = _saving_lib()
    visited = {id(layer)}
    failed, errors = set(), {}
    for attr, child in lib._walk_saveable(layer):
        child_path = f"{path}/{attr}" if path else attr
        if isinstance(child, _keras_saveable()):
            lib._load_state(child, store, None, child_path, False, visited, failed, errors)
        elif isinstance(child, (list, dict, tuple)):
            lib._load_container_state(
                child, store, None, child_path, False, visited, failed, errors
            )
    if failed:
        _, error = errors[next(iter(failed))]
        raise error


def _keras_saveable():
    from keras.src.saving.keras_saveable import KerasSaveable

    return KerasSaveable


# --- What the version test guards --------------------------------------------


def relied_on():
    """The private Keras functions keras_comm replaces, calls or mirrors, by name.

    Replaced (their originals): the four trainer methods, the
    optimizer's gradient all-reduce and, mirrored, the epoch iterator's
    `_enumerate_iterator` (with the `reset`/`__next__` that drive it). Called: the accessors above. Mirrored or
    relied on for behaviour: the base trainer's metric logs (the exact metric
    reduction mirrors `get_metrics_result` and the key test of
    `_get_metrics_result_or_logs`), `predict`'s cross-worker concat, the
    loss reduction that `_unknown_if_empty` works around, and the optimizer
    update the gradient hook feeds.

    Uninitialised variables (`keep_uninitialized`, `is_uninitialized`,
    `deferred_initializer`; FullyShard and Pipeline): `KerasVariable.__init__`
    is what leaves `_value` None and keeps `_initializer` inside a
    `StatelessScope` and queues the variable with
    `register_uninitialized_variable`; `StatelessScope.__exit__` and
    `initialize_all_variables` are what would allocate the queue (which
    `keep_uninitialized` edits through `global_state`), and
    `KerasVariable._deferred_initialize` is what would consume `_initializer`.

    Checkpoints by structure (`weights_store_path`, `save_children`,
    `load_children`; FullyShard): `saving_lib`'s `_walk_saveable`,
    `_save_state`, `_load_state`, `_save_container_state` and
    `_load_container_state` are called with their positional signatures and
    mirrored (the child-path scheme); `H5IOStore.make` / `.get` and their
    `ShardedH5IOStore` overrides are what set the `_h5_entry_path` read.
    """
    from keras.src.backend.common import global_state
    from keras.src.backend.common import stateless_scope
    from keras.src.backend.common import symbolic_scope
    from keras.src.backend.common import variables as common_variables
    from keras.src.backend.tensorflow import trainer as tf_trainer
    from keras.src.losses import loss as loss_module
    from keras.src.optimizers import base_optimizer
    optimizer = _optimizer_class()
    saving_lib = _saving_lib()
    trainer = _base_trainer_class()
    out = {
        f"TensorFlowTrainer.{name}": trainer_method(name) for name in TRAINER_METHODS
    }
    out.update({
        "TFOptimizer._all_reduce_sum_gradients": upstream_gradient_reduction(),
        "TFOptimizer._backend_update_step": optimizer._backend_update_step,
        "TensorFlowTrainer._autoconvert_optionals": trainer_class().__dict__.get(
            "_autoconvert_optionals"
        ),
        "TFEpochIterator._get_iterator": tf_trainer.TFEpochIterator._get_iterator,
        # Mirrored by `enumerate_epoch_one_iterator`; the base's, which
        # TFEpochIterator inherits (and `__next__`/`reset` drive).
        "EpochIterator._enumerate_iterator": upstream_enumerate_iterator(),
        "EpochIterator.reset": _epoch_iterator_classes()[0].reset,
        "TFEpochIterator.__next__": tf_trainer.TFEpochIterator.__next__,
        # keras_comm's predict step is called as upstream's: a list of batches.
        "TensorFlowTrainer.predict": trainer_class().predict,
        "Trainer._symbolic_build": trainer._symbolic_build,
        "Trainer._compute_loss": trainer._compute_loss,
        "Trainer.get_metrics_result": trainer.get_metrics_result,
        "Trainer._get_metrics_result_or_logs": trainer._get_metrics_result_or_logs,
        "reduce_per_replica": tf_trainer.reduce_per_replica,
        "_multi_worker_concat": tf_trainer._multi_worker_concat,
        "reduce_values": loss_module.reduce_values,
        "unscale_loss_for_distribution": loss_module.unscale_loss_for_distribution,
        "BaseOptimizer._get_current_learning_rate": base_optimizer.BaseOptimizer._get_current_learning_rate,
        "BaseOptimizer._clip_gradients": base_optimizer.BaseOptimizer._clip_gradients,
        "BaseOptimizer._use_weight_decay": base_optimizer.BaseOptimizer._use_weight_decay,
        "Layer._track_variable": keras.layers.Layer._track_variable,
        "in_symbolic_scope": symbolic_scope.in_symbolic_scope,
        # Adapted to several workers (callbacks._keras_callbacks): the list's
        # constructor, and where each callback reads the path it writes.
        "CallbackList.__init__": upstream_callback_list_init(),
        "ModelCheckpoint.__init__": keras.callbacks.ModelCheckpoint.__init__,
        "ModelCheckpoint._save_model": keras.callbacks.ModelCheckpoint._save_model,
        "ModelCheckpoint._get_file_path": keras.callbacks.ModelCheckpoint._get_file_path,
        "CSVLogger.on_train_begin": keras.callbacks.CSVLogger.on_train_begin,
        "TensorBoard.set_model": keras.callbacks.TensorBoard.set_model,
        "BackupAndRestore.__init__": keras.callbacks.BackupAndRestore.__init__,
        # Uninitialised variables (FullyShard, Pipeline).
        "KerasVariable.__init__": common_variables.Variable.__init__,
        "KerasVariable._deferred_initialize": common_variables.Variable._deferred_initialize,
        "register_uninitialized_variable": common_variables.register_uninitialized_variable,
        "initialize_all_variables": common_variables.initialize_all_variables,
        "StatelessScope.__exit__": stateless_scope.StatelessScope.__exit__,
        "global_state.get_global_attribute": global_state.get_global_attribute,
        "global_state.set_global_attribute": global_state.set_global_attribute,
        # Checkpoints by structure (FullyShard).
        "saving_lib._walk_saveable": saving_lib._walk_saveable,
        "saving_lib._save_state": saving_lib._save_state,
        "saving_lib._load_state": saving_lib._load_state,
        "saving_lib._save_container_state": saving_lib._save_container_state,
        "saving_lib._load_container_state": saving_lib._load_container_state,
        "H5IOStore.make": saving_lib.H5IOStore.make,
        "H5IOStore.get": saving_lib.H5IOStore.get,
        "ShardedH5IOStore.make": saving_lib.ShardedH5IOStore.__dict__.get("make"),
        "ShardedH5IOStore.get": saving_lib.ShardedH5IOStore.__dict__.get("get"),
        # keras.distribution on TensorFlow (keras_comm.distribution): the
        # hook wraps `_initialize_with_initializer` and hands `_initialize`
        # a tf.Variable; reads of the storage follow `value`, autocast and
        # the stateless scope; `Layer.__call__` asks for output layouts.
        "TFVariable._initialize_with_initializer": keras.Variable.__dict__.get(
            _INITIALIZE_ORIGINAL_ATTR, (keras.Variable._initialize_with_initializer,)
        )[0],
        "TFVariable._initialize": keras.Variable.__dict__.get(
            _INITIALIZE_ORIGINAL_ATTR, (None, keras.Variable._initialize)
        )[1],
        "TFVariable.__tf_tensor__": keras.Variable.__tf_tensor__,
        "KerasVariable.value": common_variables.Variable.value.fget,
        "KerasVariable.assign": common_variables.Variable.assign,
        "KerasVariable._maybe_autocast": common_variables.Variable._maybe_autocast,
        "BaseOptimizer.add_variable_from_reference": (
            base_optimizer.BaseOptimizer.add_variable_from_reference
        ),
        "Layer.__call__": keras.layers.Layer.__call__,
        # Split compute (keras_comm.distribution._split) replaces these calls
        # with the same maths on a kernel block, reading `_kernel` /
        # `_embeddings` where their properties add nothing (no LoRA, not
        # quantized).
        "Dense.call": upstream_layer_call("dense"),
        "EinsumDense.call": upstream_layer_call("einsum_dense"),
        "Embedding.call": upstream_layer_call("embedding"),
        "Dense.kernel": keras.layers.Dense.kernel.fget,
        "EinsumDense.kernel": keras.layers.EinsumDense.kernel.fget,
        "Embedding.embeddings": keras.layers.Embedding.embeddings.fget,
        "StatelessScope.get_current_value": stateless_scope.StatelessScope.get_current_value,
    })
    return {name: fn for name, fn in out.items() if fn is not None}

