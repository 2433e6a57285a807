"""The only place keras_comm reaches into Keras's and TensorFlow's private code.

`keras_api` holds every private Keras attribute keras_comm reads, calls or
replaces; `tf_api` every private TensorFlow one (the collective primitives'
internals, graph surgery, the distributed-variable and replica-context
internals). Each access is one named function whose docstring says why it is
needed. No other keras_comm module imports ``keras.src`` or
``tensorflow.python`` or touches an underscored attribute of a Keras or
TensorFlow object.

Each module's `relied_on()` lists the private functions keras_comm calls,
replaces or mirrors; tests/compat/test_private_api.py hashes their source per Keras
(or TensorFlow) version and fails when upstream changes one, so a new release
is reviewed here instead of breaking silently.
"""
