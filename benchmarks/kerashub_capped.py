"""A KerasHub Llama larger than one worker: trained, saved and resumed on N
workers under a per-process memory cap, sharded by its own layout map or by
FullyShard; the unsharded model is stopped by the same cap.

Modes (``--mode``):

* ``plain``: built under MultiWorkerMirroredStrategy alone (data parallel:
  every worker holds the whole model, its gradients and Adam's slots);
* ``layout``: built inside ``keras.distribution.ModelParallel(layout_map=
  LlamaBackbone.get_layout_map(mesh), batch_dim_name="batch").scope()`` on a
  ``(batch, model)`` mesh (``--mesh``, default ``1,N``) of the job's replicas;
* ``fully_shard``: built inside ``keras_comm.parallel.deferred_weights()``
  (no weight allocated), then ``keras_comm.parallel.fully_shard``.

Phases (``--phase``), each one launch of fresh workers:

* ``first``: two epochs of ``--steps`` global batches each (the same batches
  every epoch) under `keras_comm.callbacks.BackupAndRestore`; the backup
  made after epoch 1 is kept aside (the "interruption"), and the model after
  epoch 2 is saved to ``DIR/MODE.uninterrupted.weights.h5``;
* ``resume``: the same script, started on the kept backup: it restores
  epoch 1 (weights and Adam's state), trains epoch 2 and saves
  ``DIR/MODE.resumed.weights.h5``, then compares both files entry by entry
  (weights and optimizer variables, read one at a time).

Every worker runs under a cap on its resident memory (`benchmarks.fsdp_capped`:
a watchdog reading /proc/self/statm, exit 137 once exceeded) and writes
``DIR/MODE.PHASE.rankR.json`` with its peak RSS per phase, the state it
stores and the ideal (`ideal`), or ``DIR/MODE.PHASE.rankR.capped.json`` when
the cap stopped it (``--budget-mib`` instead caps each worker's growth
above its RSS before the model is built). The benchmark's runs (4 workers,
one at a time):

    python -m keras_comm_run -n 4 -m benchmarks.kerashub_capped --model llama160m --mode MODE --phase first --cap-mib 3300 --dir DIR
    python -m keras_comm_run -n 4 -m benchmarks.kerashub_capped --model llama160m --mode MODE --phase resume --cap-mib 3300 --dir DIR

with MODE plain, layout and fully_shard. ``python -m
benchmarks.kerashub_capped --table DIR`` prints the results table from the
rank files (docs/results/kerashub_cap_llama160m.json holds the measured one).
"""

import argparse
import glob
import json
import os
import shutil
import sys
import time
from pathlib import Path

MIB = 2**20
FLOAT32 = 4

#: name -> LlamaBackbone arguments; every dimension the layout map splits
#: divides by 4. ``llama48m``: 48.2M parameters, 8 blocks (184 MiB of
#: float32 weights; with gradients and Adam's two slots 736 MiB).
#: ``llama111m``: 111.3M parameters, 90% of them in the
#: vocabulary-sized embedding and output projection (1.66 GiB of such
#: state, a cheap step). ``llama12m`` (12.8M) and ``llama3m`` (3.4M):
#: quicker runs. ``llama160m``: 159.4M parameters, 8 blocks of hidden size
#: 1024 (2432 MiB of weights, gradients and Adam's slots unsharded): the benchmark's
#: (its unsharded state stops a worker at a cap the sharded modes pass).
CONFIGS = {
    "llama160m": dict(vocabulary_size=16384, num_layers=8, num_query_heads=16,
                      num_key_value_heads=8, hidden_dim=1024, intermediate_dim=4096),
    "llama111m": dict(vocabulary_size=65536, num_layers=2, num_query_heads=8,
                      num_key_value_heads=4, hidden_dim=768, intermediate_dim=1536),
    "llama48m": dict(vocabulary_size=16384, num_layers=8, num_query_heads=8,
                     num_key_value_heads=4, hidden_dim=512, intermediate_dim=2048),
    "llama12m": dict(vocabulary_size=8192, num_layers=4, num_query_heads=8,
                     num_key_value_heads=4, hidden_dim=384, intermediate_dim=1024),
    "llama3m": dict(vocabulary_size=4096, num_layers=2, num_query_heads=4,
                    num_key_value_heads=4, hidden_dim=256, intermediate_dim=512),
}
MODES = ("plain", "layout", "fully_shard")
PHASES = ("first", "resume")


def params_of(config):
    """``(parameters, largest weight)`` of `config` (a CONFIGS value): the
    untied token embedding and output projection, each block's attention
    (query and output ``h*h``, key and value ``h*kv*h/q``), gated MLP
    (``3*h*f``) and two RMS norm scales, and the final norm."""
    v, h, f = config["vocabulary_size"], config["hidden_dim"], config["intermediate_dim"]
    kv = h * config["num_key_value_heads"] // config["num_query_heads"]
    block = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    return 2 * v * h + config["num_layers"] * block + h, max(v * h, h * f)


def ideal(mode, config, workers, per_replica_batch, seq):
    """What `mode` must hold per worker, in bytes: ``{"state", "transient", "total"}``.

    * state: weights, gradients and Adam's two slots, float32, at the size
      this worker stores them: whole for ``plain`` (16 P bytes), 1/N for the
      sharded modes (16 P / N; the RMS norm scales, 0.1% of P, counted as
      split too).
    * transient, the largest of: the logits of this worker's samples with
      their gradient (8 bytes x batch x sequence x vocabulary; the largest
      activation) and, for ``fully_shard``, one gathered weight with its
      gradient (8 bytes x the largest weight). Under Llama's layout map no
      weight is gathered whole in a step (its kernels and embeddings split
      the compute), so ``layout`` has no such term.
    """
    params, largest = params_of(config)
    stored = params if mode == "plain" else -(-params // workers)
    state = {"weights": FLOAT32 * stored, "gradients": FLOAT32 * stored,
             "slots": 2 * FLOAT32 * stored}
    transient = {"logits": 2 * FLOAT32 * per_replica_batch * seq * config["vocabulary_size"]}
    if mode == "fully_shard":
        transient["gathered weight"] = 2 * FLOAT32 * largest
    biggest = max(transient.values())
    transient = {k: v for k, v in transient.items() if v == biggest}
    return {"state": state, "transient": transient,
            "total": sum(state.values()) + sum(transient.values())}


def data(config, steps, global_batch, seq):
    """`steps` global batches of random tokens (the same on every worker)."""
    import numpy as np

    rng = np.random.RandomState(7)
    n = steps * global_batch
    tokens = rng.randint(1, config["vocabulary_size"], size=(n, seq + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((n, seq), "bool")}
    return x, tokens[:, 1:]


def build(mode, config, strategy, mesh_shape=None, seed=1):
    """The compiled LlamaCausalLM of `config` in `mode` under `strategy`."""
    import keras
    import keras_hub

    import keras_comm
    from keras_comm import parallel

    keras.utils.set_random_seed(seed)

    def make():
        backbone = keras_hub.models.LlamaBackbone(dropout=0.0, **config)
        return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)

    def compile_(model):
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=False,
        )

    if mode == "layout":
        devices = keras_comm.distribution.list_devices(strategy)
        mesh = keras.distribution.DeviceMesh(mesh_shape or (1, len(devices)),
                                             ("batch", "model"), devices=devices)
        distribution = keras.distribution.ModelParallel(
            layout_map=keras_hub.models.LlamaBackbone.get_layout_map(mesh),
            batch_dim_name="batch",
        )
        with strategy.scope(), distribution.scope():
            model = make()
            compile_(model)
        return model
    with strategy.scope():
        if mode == "fully_shard":
            with parallel.deferred_weights():
                model = make()
            parallel.fully_shard(model)
        elif mode == "plain":
            model = make()
        else:
            raise ValueError(f"`mode` must be one of {MODES}. Received: mode={mode!r}")
        compile_(model)
    return model


def stored_bytes(model, strategy):
    """Bytes this worker's first replica stores for the model's weights and
    its optimizer's variables (a split weight: its block or shard)."""
    import numpy as np

    total = 0
    variables = list(model.weights) + list(model.optimizer.variables)
    for v in variables:
        local = strategy.experimental_local_results(v.value)[0]
        total += int(np.prod(local.shape)) * local.dtype.size
    return total


def compare_files(a, b):
    """Largest relative difference ``|x - y| / max(|y|, 1e-30)`` (per entry,
    max-norm) between two `.weights.h5` files, reading one entry at a time;
    and the number of entries compared. Raises if their entries differ."""
    import h5py
    import numpy as np

    def names(f):
        out = []
        f.visititems(lambda name, obj: out.append(name) if isinstance(obj, h5py.Dataset) else None)
        return out

    worst = 0.0
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        na, nb = names(fa), names(fb)
        if na != nb:
            raise ValueError(f"{a} and {b} hold different entries: {sorted(set(na) ^ set(nb))}")
        for name in na:
            x, y = np.asarray(fa[name], "float64"), np.asarray(fb[name], "float64")
            scale = max(float(np.max(np.abs(y), initial=0.0)), 1e-30)
            worst = max(worst, float(np.max(np.abs(x - y), initial=0.0)) / scale)
    return worst, len(na)


def _save(model, strategy, path):
    """`model.save_weights(path)` on every worker (split weights are gathered
    collectively); only the chief's file is kept."""
    import keras_comm

    if keras_comm.topology.is_chief(strategy):
        model.save_weights(path)
        return
    tmp = f"{path}.rank{keras_comm.topology.task_id(strategy)}.tmp.weights.h5"
    model.save_weights(tmp)
    os.remove(tmp)


def _prefix(args, rank):
    return Path(args.dir) / f"{args.mode}.{args.phase}.rank{rank}"


def run(args, rank, cap_record=None):
    import tensorflow as tf

    import keras
    import keras_hub  # noqa: F401  (imported before the baseline: the model is what is measured)
    import keras_comm
    from benchmarks import fsdp_capped
    from benchmarks import memory

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    # After the strategy: the sampler's allocator queries start TensorFlow's runtime.
    sampler = memory._Sampler()
    if cap_record is not None:
        enter = sampler.enter

        def entering(phase):
            cap_record["stopped_in"] = phase  # what the cap's record says, if it stops here
            enter(phase)

        sampler.enter = entering
    n = strategy.num_replicas_in_sync
    config = CONFIGS[args.model]
    chief = keras_comm.topology.is_chief(strategy)
    directory = Path(args.dir)
    backup = directory / f"{args.mode}.backup"
    kept = directory / f"{args.mode}.epoch1"
    if args.phase == "resume":
        if chief:
            shutil.rmtree(backup, ignore_errors=True)
            shutil.copytree(kept, backup)
        strategy.gather(tf.constant([0]), 0)  # the copy is in place for every worker
    baseline = memory._maxrss_bytes()
    if args.budget_mib is not None:
        fsdp_capped.install_exit_cap(
            baseline / MIB + args.budget_mib, f"{_prefix(args, rank)}.capped.json",
            {"rank": rank, "mode": args.mode, "phase": args.phase, "model": args.model,
             "baseline_mib": baseline / MIB, "budget_mib": args.budget_mib},
        )
    sampler.enter("build")
    t0 = time.perf_counter()
    model = build(args.mode, config, strategy,
                  tuple(int(s) for s in args.mesh.split(",")) if args.mesh else None)
    build_seconds = time.perf_counter() - t0
    after_build = memory._maxrss_bytes()
    x, y = data(config, args.steps, args.per_replica_batch * n, args.seq)

    class KeepEpoch1(keras.callbacks.Callback):
        # Runs after BackupAndRestore's epoch end: its epoch-1 backup is on disk.
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0 and chief and args.phase == "first":
                shutil.rmtree(kept, ignore_errors=True)
                shutil.copytree(backup, kept)

    clock = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            clock.append(time.perf_counter() - self.t)

    class BackupPhase(keras.callbacks.Callback):
        # Before BackupAndRestore's epoch end: its save is a phase of its own.
        def on_epoch_end(self, epoch, logs=None):
            sampler.enter(f"epoch {epoch} backup")

    callbacks = [memory._phase_callback(sampler), Clock(), BackupPhase(),
                 keras_comm.callbacks.BackupAndRestore(str(backup)), KeepEpoch1()]
    history = model.fit(x, y, batch_size=args.per_replica_batch * n, epochs=2, shuffle=False,
                        verbose=0, callbacks=callbacks)
    sampler.enter("save")
    out_file = directory / f"{args.mode}.{'uninterrupted' if args.phase == 'first' else 'resumed'}.weights.h5"
    _save(model, strategy, str(out_file))
    phase_peaks = sampler.stop()
    result = {
        "mode": args.mode, "phase": args.phase, "model": args.model, "rank": rank, "workers": n,
        "mesh": args.mesh or (f"1,{n}" if args.mode == "layout" else None),
        "cap_mib": args.cap_mib, "budget_mib": args.budget_mib, "steps_per_epoch": args.steps,
        "per_replica_batch": args.per_replica_batch, "seq": args.seq,
        "params": params_of(config)[0],
        "stored_mib": stored_bytes(model, strategy) / MIB,
        "baseline_mib": baseline / MIB,
        "build_peak_above_baseline_mib": (after_build - baseline) / MIB,
        "peak_above_baseline_mib": (memory._maxrss_bytes() - baseline) / MIB,
        "peak_mib": memory._maxrss_bytes() / MIB,
        "phase_peak_mib": phase_peaks,
        "ideal_mib": {part: {k: v / MIB for k, v in part_v.items()} if isinstance(part_v, dict)
                      else part_v / MIB
                      for part, part_v in ideal(args.mode, config, n, args.per_replica_batch,
                                                args.seq).items()},
        "build_seconds": build_seconds,
        "median_step_s": sorted(clock[1:])[len(clock[1:]) // 2] if len(clock) > 1 else None,
        "epochs_run": len(history.history.get("loss", [])),
        "loss": history.history.get("loss"),
    }
    if args.phase == "resume":
        strategy.gather(tf.constant([0]), 0)  # the chief's file is complete
        rel, entries = compare_files(out_file, directory / f"{args.mode}.uninterrupted.weights.h5")
        result["resumed_vs_uninterrupted_rel"] = rel
        result["entries_compared"] = entries
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES)
    parser.add_argument("--phase", choices=PHASES, default="first")
    parser.add_argument("--model", choices=sorted(CONFIGS), default="llama48m")
    parser.add_argument("--mesh", default=None, help="layout mode's mesh, 'BATCH,MODEL'")
    parser.add_argument("--cap-mib", type=float, help="cap on each worker's RSS")
    parser.add_argument("--budget-mib", type=float,
                        help="cap on each worker's RSS above its RSS before the model is built")
    parser.add_argument("--steps", type=int, default=2, help="global batches per epoch")
    parser.add_argument("--per-replica-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--dir")
    parser.add_argument("--table", default=None, help="print the table of DIR's rank files")
    args = parser.parse_args(argv)
    if args.table:
        print(json.dumps(table(args.table), indent=1))
        return 0
    if args.mode is None or args.dir is None or (args.cap_mib is None) == (args.budget_mib is None):
        parser.error("a run needs --mode, --dir and one of --cap-mib and --budget-mib")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    rank = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)
    record = None
    if args.cap_mib is not None:
        from benchmarks import fsdp_capped

        # The record is written when the cap stops the process; `run` keeps
        # its "stopped_in" at the phase being measured (build, step i, save).
        record = {"rank": rank, "mode": args.mode, "phase": args.phase, "model": args.model,
                  "stopped_in": "start"}
        fsdp_capped.install_exit_cap(args.cap_mib, f"{_prefix(args, rank)}.capped.json", record)
    result = run(args, rank, record)
    Path(f"{_prefix(args, rank)}.json").write_text(json.dumps(result))
    print(f"[capped] rank {rank}: {args.mode} {args.phase} trained under the cap, peak RSS "
          f"{result['peak_mib']:.0f} MiB ({result['peak_above_baseline_mib']:.0f} above its "
          f"baseline; ideal {result['ideal_mib']['total']:.0f})", flush=True)
    return 0


COLUMNS = ["mode", "result", "peak RSS per rank (MiB)", "peak above the baseline (MiB)",
           "ideal (MiB)", "ratio", "stored per rank (MiB)", "median step (s)",
           "resumed vs uninterrupted (max rel.)"]


def table(directory):
    """The docs/results table of the rank files in `directory`: a dict with
    ``columns`` (`COLUMNS`), ``rows`` and ``cap_mib``. A mode's peak above
    the baseline is its largest rank's over both phases."""
    rows, caps = [], set()
    for mode in MODES:
        files = sorted(glob.glob(os.path.join(directory, f"{mode}.first.rank*.json")))
        if not files:
            continue
        first = [json.loads(Path(p).read_text()) for p in files]
        caps |= {r["cap_mib"] for r in first}
        capped = sorted((r for r in first if "stopped_at_rss_mib" in r), key=lambda r: r["rank"])
        if capped:
            where = sorted({c["stopped_in"] for c in capped if "stopped_in" in c})
            rows.append([mode, f"stopped by the cap ({capped[0]['cap_mib']:.0f} MiB)"
                         + (f" in {', '.join(where)}" if where else ""),
                         " / ".join(f"rank {c['rank']}: > {c['cap_mib']:.0f}" for c in capped),
                         "–", "–", "–", "–", "–", "–"])
            continue
        resumed = [json.loads(Path(p).read_text())
                   for p in glob.glob(os.path.join(directory, f"{mode}.resume.rank*.json"))]
        stopped = [r for r in resumed if "stopped_at_rss_mib" in r]
        resumed = [r for r in resumed if "stopped_at_rss_mib" not in r]
        first.sort(key=lambda r: r["rank"])
        worst = max(r["peak_above_baseline_mib"] for r in first + resumed)
        r0 = first[0]
        want = ideal(mode, CONFIGS[r0["model"]], r0["workers"], r0["per_replica_batch"],
                     r0["seq"])["total"] / MIB
        result = "trained 2 epochs, saved"
        if resumed and not stopped:
            result += ", resumed from its epoch-1 backup"
        elif stopped:
            result += "; the resume was stopped by the cap"
        rel = max((r["resumed_vs_uninterrupted_rel"] for r in resumed), default=None)
        rows.append([
            mode, result, " / ".join(f"{r['peak_mib']:.0f}" for r in first),
            f"{worst:.0f}", f"{want:.0f}", f"{worst / want:.1f}",
            f"{first[0]['stored_mib']:.0f}", f"{first[0]['median_step_s']:.1f}",
            "–" if rel is None else f"{rel:.1e}",
        ])
    return {"columns": COLUMNS, "rows": rows, "cap_mib": sorted(caps)}


if __name__ == "__main__":
    sys.exit(main())
