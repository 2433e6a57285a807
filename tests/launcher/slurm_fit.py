"""Worker: `fit` with BackupAndRestore, started by keras-comm-run under Slurm.

Usage: slurm_fit.py STATE_DIR [--pause-once]

Trains tests/_shared's resume model on its dataset (global batch 8, 12 steps
per epoch, 2 epochs) with `keras_comm.callbacks.BackupAndRestore(STATE_DIR/
backup, save_freq=5)`. With `--pause-once` and no `STATE_DIR/paused` marker,
every rank stops before global step 17, once the backup of step 15 is on
disk; the chief then writes the marker and all ranks wait to be killed (the
test kills the Slurm job step). Each rank writes its result: the cluster it
saw, its final weights and what the backup restored.

`train` is also the test's one-process reference (the same training under
the default strategy, in the test's process).
"""

import json
import os
import sys
import time
from pathlib import Path

GLOBAL_BATCH = 8
STEPS = 12
EPOCHS = 2
SAVE_FREQ = 5
PAUSE_STEP = 17  # epoch 1, batch 5: after the backup of global step 15


def train(strategy, callbacks=()):
    """The resume model fitted under `strategy`; returns the model."""
    from _shared import resume_dataset, resume_model

    model = resume_model(strategy, units=8, learning_rate=0.02)
    model.fit(resume_dataset(GLOBAL_BATCH, STEPS), epochs=EPOCHS, verbose=0, callbacks=list(callbacks))
    return model


def pause_once(state):
    """A callback that waits before PAUSE_STEP until the job step is killed."""
    import keras

    class PauseOnce(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if self.epoch * STEPS + batch != PAUSE_STEP:
                return
            backup = state / "backup"
            deadline = time.time() + 120
            while not any(n.startswith("ckpt-1-3") for n in os.listdir(backup)):
                if time.time() > deadline:
                    raise RuntimeError(f"no backup of global step 15 in {backup}")
                time.sleep(0.05)
            if int(os.environ["RANK"]) == 0:
                (state / "paused").write_text(json.dumps({"step": PAUSE_STEP, "pid": os.getpid()}))
            time.sleep(300)  # the test kills the job step meanwhile
            raise RuntimeError("the job step was not killed")

    return PauseOnce()


def main(state_dir, pause):
    import tensorflow as tf

    from _cluster import write_result

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras_comm  # after the strategy: TF_CONFIG is read once

    state = Path(state_dir)
    state.mkdir(parents=True, exist_ok=True)
    backup = keras_comm.callbacks.BackupAndRestore(str(state / "backup"), save_freq=SAVE_FREQ)
    callbacks = [backup]
    if pause and not (state / "paused").exists():
        callbacks.insert(0, pause_once(state))
    model = train(strategy, callbacks)
    write_result({
        "rank": int(strategy.cluster_resolver.task_id),
        "replicas": strategy.num_replicas_in_sync,
        "workers": json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"],
        "slurm_procid": os.environ.get("SLURM_PROCID"),
        "restored": backup.restored,
        "weights": [w.tolist() for w in model.get_weights()],
    })


if __name__ == "__main__":
    from _cluster import finish

    main(sys.argv[1], "--pause-once" in sys.argv[2:])
    finish()
