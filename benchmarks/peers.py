"""Peers: `model.fit` under Keras 3 + keras_comm next to tf-keras (Keras 2).

The comparison a user moving from tf-keras makes: the same model (784-1024-
1024-10 MLP, Adam 1e-3, sparse categorical cross-entropy from logits), the
same synthetic data (`Dataset.from_tensor_slices(...).batch(global).cache()`,
auto-shard DATA), the same global batch, each framework under its own
MultiWorkerMirroredStrategy in its own worker processes (started by
`keras_comm_run.run`, which only sets TF_CONFIG; the tf-keras workers never
import keras_comm or Keras 3). Jobs alternate framework by framework, round
by round, so both see the same background load.

Each job runs one `fit` of `epochs` epochs and records, on every rank, each
epoch's wall time end to end (``wall_epoch_s``: from one `on_epoch_end` to
the next, the first from `on_train_begin`), so the work either framework does
between epochs counts for both: tf-keras creates each epoch's iterator before
`on_epoch_begin`, Keras 3 inside its first step. The first epoch traces and
is reported apart; samples/s is computed from the median of the others (the
slowest rank's time per epoch: a synchronous step ends with it), so a stall
in any later epoch shows as a slow epoch. The time inside each epoch alone
(``epoch_s``, `on_epoch_begin` to `on_epoch_end`, which leaves tf-keras's
iterator creation out and keeps Keras 3's in) is reported beside it, as
``in_epoch_samples_per_s``, and so is the whole `fit` call (``fit_s``).

Worker: ``python -m benchmarks.peers --framework keras_comm|tf_keras --out F``
(under the launcher). Driver: `run_jobs` + `summarize` (benchmarks.run's
``peers`` family).
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

FRAMEWORKS = ("keras_comm", "tf_keras")
GLOBAL_BATCH = 256
SAMPLES = 10240  # 40 global batches per epoch


def _keras(framework):
    if framework == "tf_keras":
        import tf_keras

        return tf_keras
    import keras

    import keras_comm  # noqa: F401  (Keras 3 x MWMS fixes for model.fit)

    return keras


def build(framework, samples=SAMPLES, global_batch=GLOBAL_BATCH):
    """The peers' setup on this worker: ``(keras module, strategy, model, dataset)``.

    The same MLP, optimizer, loss and data for either framework, under its own
    MultiWorkerMirroredStrategy (shared with `benchmarks.step_profile`).
    """
    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    k = _keras(framework)
    rng = np.random.default_rng(0)
    x = rng.random((samples, 784), dtype=np.float32)
    y = rng.integers(0, 10, samples).astype(np.int32)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch).cache().with_options(options)
    with strategy.scope():
        k.utils.set_random_seed(0)
        model = k.Sequential([
            k.Input((784,)),
            k.layers.Dense(1024, activation="relu"),
            k.layers.Dense(1024, activation="relu"),
            k.layers.Dense(10),
        ])
        model.compile(
            optimizer=k.optimizers.Adam(1e-3),
            loss=k.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return k, strategy, model, ds


def measure(framework, epochs, samples, global_batch):
    """One `fit` of `epochs` epochs on this worker; each epoch's seconds."""
    k, strategy, model, ds = build(framework, samples, global_batch)

    class EpochTimer(k.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.epochs = []
            self.wall = []
            self._mark = time.perf_counter()

            self.first_step = []
            self.max_step = []

        def on_epoch_begin(self, epoch, logs=None):
            self._begin = self._last = time.perf_counter()
            self._steps = []

        def on_train_batch_end(self, batch, logs=None):
            now = time.perf_counter()
            self._steps.append(now - self._last)
            self._last = now

        def on_epoch_end(self, epoch, logs=None):
            now = time.perf_counter()
            self.epochs.append(now - self._begin)
            self.wall.append(now - self._mark)
            self._mark = now
            # The first step of an epoch is where the iterator handover stalled.
            self.first_step.append(self._steps[0] if self._steps else None)
            self.max_step.append(max(self._steps) if self._steps else None)

        def on_train_end(self, logs=None):
            self.train_end = time.perf_counter()

    timer = EpochTimer()
    start = time.perf_counter()
    model.fit(ds, epochs=epochs, verbose=0, callbacks=[timer])
    fit_s = time.perf_counter() - start
    # From the last callback to fit's return: where the last epoch's iterator
    # is destroyed (stock: as fit's frame goes; keras_comm: its release
    # threads joined), so what ending fit costs.
    fit_end_s = time.perf_counter() - timer.train_end
    return {
        "framework": framework,
        "rank": strategy.cluster_resolver.task_id or 0,
        "workers": strategy.num_replicas_in_sync,
        "epoch_s": timer.epochs,
        "wall_epoch_s": timer.wall,
        "fit_s": fit_s,
        "first_step_s": timer.first_step,
        "max_step_s": timer.max_step,
        "fit_end_s": fit_end_s,
        "samples": samples,
        "global_batch": global_batch,
        "version": k.__version__,
    }


def run_jobs(launch, workers, rounds, epochs, raw_dir, env, log_stream, say=print,
             samples=SAMPLES, global_batch=GLOBAL_BATCH, timeout=900, frameworks=FRAMEWORKS):
    """Launches the peer jobs, interleaved: for each round, for each n, each framework.

    Returns:
        {str(n): {framework: [job result, ...]}}, a job result being
        ``{"ranks": [rank dicts], "code": exit code, "round": r}``.
    """
    out = {str(n): {f: [] for f in frameworks} for n in workers}
    for r in range(rounds):
        for n in workers:
            # Alternate which framework goes first, so neither always follows
            # the other's teardown.
            order = frameworks if r % 2 == 0 else tuple(reversed(frameworks))
            for framework in order:
                tag = f"peers_{framework}_n{n}_r{r}"
                code = launch.run(
                    ["-m", "benchmarks.peers", "--framework", framework, "--epochs", str(epochs),
                     "--samples", str(samples), "--global-batch", str(global_batch),
                     "--out-dir", str(raw_dir), "--tag", tag],
                    n, timeout=timeout, env=env, stdout=log_stream, stderr=log_stream,
                )
                ranks = []
                for rank in range(n):
                    path = Path(raw_dir) / f"{tag}.rank{rank}.json"
                    ranks.append(json.loads(path.read_text()) if path.exists() else None)
                job = {"ranks": ranks if all(ranks) else None, "code": code, "round": r}
                out[str(n)][framework].append(job)
                if job["ranks"]:
                    s = _job_summary(job["ranks"])
                    say(f"[peers n={n}] {framework} round {r}: {s['samples_per_s']:.0f} samples/s "
                        f"({s['in_epoch_samples_per_s']:.0f} inside epochs), fit {s['fit_s']:.2f} s, "
                        f"epochs end to end {', '.join(f'{t:.2f}' for t in s['wall_epoch_s'])} s, later epochs' "
                        f"first steps {', '.join(f'{t:.3f}' for t in s['first_step_s'] or [])} s"
                        + (f", fit end {s['fit_end_s']:.3f} s" if s["fit_end_s"] is not None else ""))
                else:
                    say(f"[peers n={n}] {framework} round {r}: failed (exit {code}; see run.log)")
    return out


def _slowest(ranks, key):
    length = min(len(r[key]) for r in ranks)
    return [max(r[key][i] for r in ranks) for i in range(length)]


def _job_summary(ranks):
    """The slowest rank's epoch times; samples/s from the median after the first.

    samples/s counts each later epoch end to end (``wall_epoch_s``); jobs
    recorded before that was measured fall back to the in-epoch time.
    """
    epochs = _slowest(ranks, "epoch_s")
    length = len(epochs)
    wall = _slowest(ranks, "wall_epoch_s") if all("wall_epoch_s" in r for r in ranks) else epochs
    later = wall[1:] or wall
    med = statistics.median(later)
    in_epoch = statistics.median(epochs[1:] or epochs)
    return {
        "epoch_s": epochs,
        "wall_epoch_s": wall,
        "median_epoch_s": med,
        "samples_per_s": ranks[0]["samples"] / med,
        "in_epoch_samples_per_s": ranks[0]["samples"] / in_epoch,
        "fit_s": max(r["fit_s"] for r in ranks) if all("fit_s" in r for r in ranks) else None,
        # How far the slowest later epoch is above the median: a stall shows here.
        "worst_epoch_excess_s": max(later) - med,
        # Each later epoch's first step, slowest rank (where the stall was).
        "first_step_s": [max(r["first_step_s"][i] for r in ranks) for i in range(1, length)]
        if all("first_step_s" in r for r in ranks) else None,
        # From the last callback to fit's return, slowest rank.
        "fit_end_s": max(r["fit_end_s"] for r in ranks)
        if all("fit_end_s" in r for r in ranks) else None,
    }


def summarize(jobs):
    """`run_jobs`'s result -> rows per worker count: medians over rounds and the ratio."""
    rows = []
    for n, per_framework in sorted(jobs.items(), key=lambda kv: int(kv[0])):
        row = {"workers": int(n)}
        for framework, runs in per_framework.items():
            summaries = [_job_summary(j["ranks"]) for j in runs if j["ranks"]]
            if not summaries:
                row[framework] = {"error": "no job finished (see run.log)"}
                continue
            sps = [s["samples_per_s"] for s in summaries]
            inside = [s["in_epoch_samples_per_s"] for s in summaries]
            fits = [s["fit_s"] for s in summaries if s["fit_s"] is not None]
            row[framework] = {
                "samples_per_s": statistics.median(sps),
                "samples_per_s_runs": sps,
                "in_epoch_samples_per_s": statistics.median(inside),
                "in_epoch_samples_per_s_runs": inside,
                "fit_s": statistics.median(fits) if fits else None,
                "first_epoch_s": statistics.median(s["epoch_s"][0] for s in summaries),
                "worst_epoch_excess_s": max(s["worst_epoch_excess_s"] for s in summaries),
                "later_first_step_s_median": statistics.median(
                    t for s in summaries for t in (s["first_step_s"] or [])
                ) if any(s["first_step_s"] for s in summaries) else None,
                "epoch_s_runs": [s["epoch_s"] for s in summaries],
                "version": runs[0]["ranks"][0]["version"] if runs[0]["ranks"] else None,
                "runs": len(summaries),
            }
        kc, tk = row.get("keras_comm", {}), row.get("tf_keras", {})
        if "samples_per_s" in kc and "samples_per_s" in tk:
            row["ratio"] = kc["samples_per_s"] / tk["samples_per_s"]
            # The same ratio round by round (each pair ran back to back).
            row["ratio_runs"] = [a / b for a, b in zip(kc["samples_per_s_runs"], tk["samples_per_s_runs"])]
            row["in_epoch_ratio_runs"] = [a / b for a, b in zip(kc["in_epoch_samples_per_s_runs"],
                                                                tk["in_epoch_samples_per_s_runs"])]
            row["in_epoch_ratio"] = kc["in_epoch_samples_per_s"] / tk["in_epoch_samples_per_s"]
        rows.append(row)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=FRAMEWORKS, required=True)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--samples", type=int, default=SAMPLES)
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--tag", required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    source = os.environ.get("KERAS_COMM_BENCH_SOURCE")
    if source:  # benchmarks.run --ref: that snapshot of keras_comm first
        sys.path.insert(0, source)
    result = measure(args.framework, args.epochs, args.samples, args.global_batch)
    path = Path(args.out_dir) / f"{args.tag}.rank{result['rank']}.json"
    path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
