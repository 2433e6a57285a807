"""LocalNormLogger: the mirror layers' local gradient norms in `fit`'s logs."""

import keras


class LocalNormLogger(keras.callbacks.Callback):
    """Adds every ``dump_local_norm=True`` mirror layer's local norm to `fit`'s logs.

    The mirror layers (`MirrorOperator`, `MirrorMicroStepOperator`,
    `MicroStepAllGather`) built with ``dump_local_norm=True`` set their
    per-replica ``local_norm`` weight inside their backward, to the L2 norm
    of this replica's gradient before it is reduced (MindSpore's
    dump_local_norm prints it there). This callback reads, after each
    batch, the value of this worker's (first local) replica and adds it to
    the batch logs as ``local_grad_norm/<layer path>``, and the last batch's
    values to the epoch logs (so `History` keeps them). Each worker logs its
    own replica's norms: they differ between workers, which is the point.

    Put it before callbacks that should see the values (e.g. a CSV logger);
    Keras's progress bar and History see them wherever it is.

    Example:

    ```python
    model.fit(x, y, callbacks=[keras_comm.callbacks.LocalNormLogger()])
    ```
    """

    def __init__(self):
        super().__init__()
        self._last = {}

    def _norms(self):
        strategy = self.model.distribute_strategy
        out = {}
        for variable in self.model.weights:
            path = getattr(variable, "path", variable.name)
            if variable.name != "local_norm":
                continue
            parts = path.split("/")[:-1]
            if len(parts) >= 2 and parts[-1] == parts[-2]:
                parts.pop()  # the weight is created in a name scope of the layer's name
            layer_path = "/".join(parts)
            value = strategy.experimental_local_results(variable.value)[0]
            out[f"local_grad_norm/{layer_path}"] = float(value.numpy())
        return out

    def on_train_batch_end(self, batch, logs=None):
        self._last = self._norms()
        if logs is not None:
            logs.update(self._last)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.update(self._last)


__all__ = ["LocalNormLogger"]
