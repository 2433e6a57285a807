"""Expert parallelism: `MixtureOfExperts` with top-k routing and AlltoAll.

Routing maths (`route`) is a pure function, tested without a cluster.
"""

import keras
import tensorflow as tf

from keras_comm import _validation
from keras_comm import ops
from keras_comm.parallel import _collectives
from keras_comm.parallel import _common
from keras_comm.parallel import sharded_weights


def capacity(num_tokens, num_experts, top_k, capacity_factor):
    """Slots per expert for `num_tokens` tokens: ``ceil(cf * T * k / E)``, >= 1."""
    t = tf.cast(num_tokens, tf.float64)
    c = tf.math.ceil(capacity_factor * t * top_k / num_experts)
    return tf.maximum(tf.cast(c, tf.int32), 1)


def route(probs, top_k, capacity_):
    """Top-k routing with a per-expert capacity.

    Tokens claim slots in priority order: every token's first choice (in
    token order), then every token's second choice, and so on (GShard).
    A (token, expert) choice that finds the expert's `capacity_` slots full
    is dropped: that expert contributes nothing to that token's output.

    Args:
        probs: ``(T, E)`` router probabilities.
        top_k: experts per token.
        capacity_: int scalar, slots per expert.

    Returns:
        ``(dispatch, combine)``, both ``(T, E, C)``: dispatch is 1 where token
        t sits in slot c of expert e; combine is that times the gate (the
        token's router probability of e). Gates are differentiable.
    """
    num_experts = tf.shape(probs)[1]
    gates, experts = tf.math.top_k(probs, k=top_k)  # (T, k)
    choice = tf.one_hot(experts, num_experts, dtype=tf.int32)  # (T, k, E)
    by_priority = tf.transpose(choice, [1, 0, 2])  # (k, T, E)
    flat = tf.reshape(by_priority, [-1, num_experts])
    position = tf.reshape(tf.cumsum(flat, axis=0, exclusive=True), tf.shape(by_priority))
    position = tf.transpose(position, [1, 0, 2])  # (T, k, E)
    keep = choice * tf.cast(position < capacity_, tf.int32)
    slot = tf.one_hot(tf.reduce_sum(position * choice, axis=2), capacity_, dtype=probs.dtype)  # (T, k, C)
    keep = tf.cast(keep, probs.dtype)
    dispatch = tf.einsum("tke,tkc->tec", keep, slot)
    combine = tf.einsum("tke,tk,tkc->tec", keep, gates, slot)
    return dispatch, combine


@keras.saving.register_keras_serializable(package="keras_comm")
class MixtureOfExperts(_common.ParallelLayer):
    """Mixture of experts whose experts are split over a group of replicas.

    Each expert is a dense layer ``act(x @ W_e + b_e)``. Each group member
    holds ``num_experts / n`` experts (a sharded weight). Per replica:
    router ``softmax(x @ W_r)`` (an ordinary replicated weight), top-k
    routing with capacity ``ceil(capacity_factor * tokens * top_k /
    num_experts)`` slots per expert for this replica's tokens (see
    `route`: choices beyond capacity are DROPPED and add nothing; add a
    residual connection around the layer to pass such tokens through),
    AlltoAll dispatch of each expert's slots to its owner, the experts,
    AlltoAll back, and the gate-weighted combine. No auxiliary
    load-balancing loss is added.

    Forward/backward: every step is differentiable; the AlltoAlls' backward
    is the reverse AlltoAll (exact adjoint), so expert weights get the
    gradient of all the group's tokens routed to them (summed over their
    data-parallel group only) and the router gets its gradient through the
    gates.

    Args:
        num_experts: number of experts; divisible by the group size.
        units: output size of every expert.
        top_k: experts per token (1 <= top_k <= num_experts).
        capacity_factor: float > 0, slots per expert relative to an even
            split of this replica's token choices.
        activation: the experts' activation.
        use_bias: whether experts have a bias.
        kernel_initializer, bias_initializer: initializers of the FULL
            expert weights ``(num_experts, input_dim, units)`` and
            ``(num_experts, units)``.
        router_initializer: initializer of the router ``(input_dim, num_experts)``.
        mesh, axis, seed, timeout: see `ParallelLayer`.

    Input shape: ``(batch, ..., input_dim)``; the same batch size on all
    members. Output shape: ``(batch, ..., units)``.

    Raises:
        ValueError: `num_experts` not divisible by the group size, bad
            `top_k` or `capacity_factor`.
    """

    def __init__(
        self,
        num_experts,
        units,
        top_k=1,
        capacity_factor=1.0,
        activation="relu",
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        router_initializer="glorot_uniform",
        mesh=None,
        axis="model",
        seed=None,
        timeout=None,
        **kwargs,
    ):
        super().__init__(mesh=mesh, axis=axis, seed=seed, timeout=timeout, **kwargs)
        num_experts = _validation.positive_int(num_experts, "num_experts")
        self.num_experts = self.split_size(num_experts, "num_experts")
        self.units = _validation.positive_int(units, "units")
        self.top_k = _validation.positive_int(top_k, "top_k")
        if top_k > num_experts:
            raise ValueError(
                f"`top_k` must be <= num_experts={num_experts}. Received: top_k={top_k}"
            )
        self.capacity_factor = float(
            _validation.positive_number(capacity_factor, "capacity_factor")
        )
        self.activation = keras.activations.get(activation)
        self.use_bias = bool(use_bias)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.router_initializer = keras.initializers.get(router_initializer)

    def build(self, input_shape):
        self.split_size(self.num_experts, "num_experts", built=True)
        d = int(input_shape[-1])
        self.router = self.add_weight(
            name="router",
            shape=(d, self.num_experts),
            initializer=sharded_weights.seeded_initializer(self.router_initializer, self.weight_seed(2) or 0),
        )
        self.kernel = sharded_weights.add_sharded_weight(
            self, "kernel", (self.num_experts, d, self.units), 0, self.mesh, self.axis,
            self.kernel_initializer, self.weight_seed(0),
        )
        self.bias = None
        if self.use_bias:
            self.bias = sharded_weights.add_sharded_weight(
                self, "bias", (self.num_experts, self.units), 0, self.mesh, self.axis,
                self.bias_initializer, self.weight_seed(1),
            )

    def call(self, inputs):
        group = self.group()
        n = group.size
        d = inputs.shape[-1]
        tokens = tf.reshape(inputs, [-1, d])
        probs = tf.nn.softmax(tf.matmul(tokens, self.router), axis=-1)
        cap = capacity(tf.shape(tokens)[0], self.num_experts, self.top_k, self.capacity_factor)
        dispatch, combine = route(probs, self.top_k, cap)
        expert_in = tf.einsum("tec,td->ecd", dispatch, tokens)  # (E, C, d)
        local = self.num_experts // n
        x = tf.reshape(expert_in, [n, local, cap, d])
        x = self._exchange(x, group)  # (source member, local expert, C, d)
        h = tf.einsum("secd,edu->secu", x, self.kernel)
        if self.bias is not None:
            h = h + self.bias[None, :, None, :]
        h = self.activation(h)
        h = self._exchange(h, group)  # (owner member, local expert, C, units)
        out = tf.einsum("tec,ecu->tu", combine, tf.reshape(h, [self.num_experts, cap, self.units]))
        return tf.reshape(out, tf.concat([tf.shape(inputs)[:-1], [self.units]], 0))

    def _exchange(self, x, group):
        if group.size == 1 or _collectives.shape_only():
            return x
        return ops.all_to_all(
            x, group.size, 0, 0, group=group, timeout=self.timeout, name=self.name
        )

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.units,)

    def get_config(self):
        config = super().get_config()
        config.update(
            num_experts=self.num_experts,
            units=self.units,
            top_k=self.top_k,
            capacity_factor=self.capacity_factor,
            activation=keras.activations.serialize(self.activation),
            use_bias=self.use_bias,
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
            bias_initializer=keras.initializers.serialize(self.bias_initializer),
            router_initializer=keras.initializers.serialize(self.router_initializer),
        )
        return config
