"""The public ReplicatedTrainer: checks, replicas, and one delegating method per action."""

from tfreduce.basis.devices import tower_devices
from tfreduce.trainer.batching import eval_batches, input_batches, with_weights, worker_batch
from tfreduce.trainer.compiled import resolve_jit_compile
from tfreduce.trainer.inspection import Inspection
from tfreduce.trainer.loop import FitHooks, evaluate_loop, fit_loop, predict_loop
from tfreduce.trainer.losses import per_example_loss_fn, takes_class_indices
from tfreduce.trainer.determinism import check_batch_for_micro_batches
from tfreduce.trainer.elastic import ElasticFit
from tfreduce.trainer.options import (StepOptions, check_trainer_options, deterministic_options,
                                      trainer_reduction)
from tfreduce.trainer.persistence import Persistence
from tfreduce.trainer.signals import StopRequest
from tfreduce.trainer.step import make_counters
from tfreduce.trainer.step_functions import build_run
from tfreduce.trainer.towers import check_factories, create_replicas, resolve_cluster


class ReplicatedTrainer(Inspection, Persistence):
    """Trains K replicas of a Keras model with one gradient all-reduce per step.

    Tower k holds a replica of the model (`models[k]`) and its own optimizer,
    all their variables on `devices[k]`. One step on a global batch of B
    examples:

    1. splits the batch into K contiguous shards, the first B % K one
       example larger (B=10, K=4 gives 3, 3, 2, 2): none dropped or repeated;
    2. runs forward and backward on every tower; tower k's loss is the sum of
       its per-example losses times K/B when `average=True` (the all-reduce
       then divides the sum by K), or times 1/B when `average=False`: the
       reduced gradient is the gradient of the mean loss over the B examples;
    3. all-reduces the K x N gradients once (its `reduction`, or PowerSGD
       around it; with `zero_stage`, a reduce-scatter and an all-gather
       around each tower's update of its shard), checks once that the
       result is finite, and applies it: every tower applies the same update
       to the same values, or none does (`on_nonfinite`);
    4. replaces the moving statistics of every trainable BatchNormalization
       layer with their average over towers weighted by shard size (one more
       all-reduce): a moving mean as one device updates it from the global
       batch; a moving variance leaves out the spread between shard means.

    At start, and after `restore`, tower 0's variables (model and optimizer)
    are broadcast to every tower; `bcast_period=n` repeats that every n steps.
    Dropout's random state is a model variable: after a broadcast every tower
    draws the same random numbers, each on its own shard of the batch.

    A model whose variables are created on first call (a Sequential without
    an Input) is built on the first batch the trainer sees.

    Several workers: the package docstring (`tfreduce.trainer`); examples: docs/training.md.

    Attributes:
      models: list of K `keras.Model`, the tower replicas; models[0] is tower 0.
      optimizers: list of K Keras optimizers, optimizers[k] updates models[k].
      devices: list of K canonical device names, devices[k] holds tower k.
      step: int, the number of training steps taken (restored by `restore`).
      cluster: the started tfreduce.Cluster, or None in a single process.
      reduction: the tfreduce.Reduction every all-reduce is built with.
      is_chief: bool, True on rank 0 (and in a single process), the
        worker that writes checkpoints and logs.
      skipped_steps: int, the steps whose update was skipped (non-finite
        gradients) since this trainer was made.
      fault_hook: None (default), or fn(step, phase) that every training
        step (of `train_step` and `fit`) calls with the steps taken so far:
        phase "start" before the step runs, "end" after it ran and before
        `fit` decides whether to stop. For fault drills and tests: raise
        KeyboardInterrupt, or send this process SIGTERM, at a chosen step.
    """

    def __init__(self, model_fn, loss, optimizer_fn, devices=None, algorithm="auto", average=True,
                 *, bcast_period=0, cluster="auto", accumulate_steps=1, on_nonfinite="raise",
                 reduction=None, powersgd=None, zero_stage=0, micro_batches=None,
                 jit_compile=False, **allreduce_options):
        """Builds one model replica and one optimizer per device.

        Args:
          model_fn: function () -> keras.Model, called once per tower under
            that tower's device so the replica's variables live there. Every
            call must build the same architecture.
          loss: a keras.losses.Loss, a Keras loss name ("mse"), or a function
            (y_true, y_pred) -> per-example losses of shape [batch] (trailing
            axes are averaged). Only per-example values are used; the
            trainer forms the global-batch mean itself.
          optimizer_fn: function () -> keras.optimizers.Optimizer, called once
            per tower; each optimizer's slots live on its tower.
          devices: list of K device names, one tower each; default all GPUs,
            or all logical CPU devices when there is no GPU.
          algorithm: str, a name in tfreduce.ALGORITHMS (the field of
            ``tfreduce.Reduction``).
          average: bool, the all-reduce's mean (True) or sum; the loss
            scaling adapts so the global-batch mean is optimised either way.
          bcast_period: int >= 0; tower 0's variables are broadcast to all
            towers every `bcast_period` steps (MegEngine's); 0: only at
            start and after restore.
          cluster: "auto", None or a tfreduce.Cluster. "auto": when the
            TF_CONFIG environment variable is set, `Cluster.from_tf_config()`;
            otherwise a single process. The cluster is started here, before
            any variable exists, so configure logical devices first. `devices`
            are then this worker's own devices.
          accumulate_steps: int M >= 1; each step takes one micro-batch, and
            every M-th reduces the gradients summed on each tower since the
            last update and applies them: the update of the M micro-batches
            as one batch.
          on_nonfinite: "raise" (default) or "skip": a step whose gradients
            hold NaN or Inf on any tower raises FloatingPointError naming
            the step, tower and variable, with no update applied; or skips
            the update on every tower, counted in fit's logs ("skipped_steps").
            A LossScaleOptimizer (mixed_float16) skips gradients that
            overflow (its scale halves; counted); a NaN or Inf loss is
            skipped leaving the scale, and is what "raise" raises for.
          reduction: a ``tfreduce.Reduction``, every all-reduce's algorithm
            and options, instead of ``algorithm`` and ``**allreduce_options``.
          powersgd: a ``tfreduce.PowerSGD``: each update's all-reduce is
            compressed with PowerSGD around the reduction (its state, per
            tower, is checkpointed); None: no PowerSGD.
          zero_stage: 0 (default: every tower holds the whole optimizer
            state), 1 (each of the T towers holds the optimizer state of
            1/T of the weights: a reduce-scatter, its own update and an
            all-gather replace the all-reduce; ZeRO, Rajbhandari et al.
            2020) or 2 (the accumulation buffers too). docs/zero.md.
          micro_batches: with ``deterministic=True`` (a Reduction option),
            int M (default 8): each global batch is M micro-batches summed
            in one fixed tree, the same bits for T = M, M/2, M/4, ...
            towers (docs/determinism.md).
          jit_compile: False (default), True or "auto": each tower's forward
            and backward pass is one XLA cluster on its device, the
            reduction and the update outside (tf_cnn_benchmarks'
            ``--xla_compile``); "auto" compiles when every tower is a GPU.
            An op XLA cannot compile raises ValueError with True, and with
            "auto" warns and runs uncompiled (trainer/compiled.py).
          **allreduce_options: the options of ``tfreduce.Reduction``, such
            as groups=[[0, 1], [2, 3]] for "hierarchical", pack_bytes=,
            compression="fp16", or topology="dgx-a100" (with algorithm
            "auto": the reduction the cost model predicts fastest there).
            In a cluster the cross-worker hop follows (4 MiB packs,
            compression on that hop only; no topology).

        Raises:
          TypeError: model_fn or optimizer_fn is not callable or returns the
            wrong type; loss is not a loss; cluster is not "auto", None or a
            Cluster; average not a bool; an option the algorithm lacks;
            reduction= with algorithm or options, or not a Reduction;
            powersgd not a PowerSGD instance, or given twice; zero_stage
            not an int; jit_compile not True, False or "auto".
          ValueError: unknown algorithm, bad or missing devices, a negative
            bcast_period or accumulate_steps < 1, a bad option value (a
            topology with a named algorithm), replicas that differ, or a
            zero_stage other than 0, 1, 2 or with an optimizer (or option,
            PowerSGD) that cannot update a shard.
        """
        check_factories(model_fn, optimizer_fn)
        # The checks that need no cluster come first.
        self.reduction, powersgd = trainer_reduction(algorithm, reduction, powersgd,
                                                     allreduce_options)
        check_trainer_options(average, bcast_period, accumulate_steps, on_nonfinite,
                              zero_stage, powersgd)
        self._cluster = resolve_cluster(cluster)
        self.devices = tower_devices(devices)
        self._options = StepOptions(
            loss_fn=per_example_loss_fn(loss), class_indices=takes_class_indices(loss),
            average=bool(average), devices=self.devices, reduction=self.reduction,
            # T, the towers of all workers, among which each global batch is split.
            total_towers=self._cluster.num_workers * len(self.devices), cluster=self._cluster,
            accumulate_steps=accumulate_steps, on_nonfinite=on_nonfinite, powersgd=powersgd,
            zero_stage=zero_stage, jit_compile=resolve_jit_compile(jit_compile, self.devices))
        self._options.check()  # devices it cannot use fail here, not at the first step
        self._elastic = ElasticFit.of_this_process(  # does nothing without the elastic launcher
            lambda folder: self._checkpoint.save(folder, every_worker=True), self._restore_prefix)
        self._elastic.check_sizes(self._options, micro_batches)
        self._options = deterministic_options(self._options, micro_batches)
        self._bcast_period = bcast_period
        self.models, self.optimizers = create_replicas(model_fn, optimizer_fn, self.devices,
                                                       zero_stage)
        self._step, self._epoch_totals = make_counters()
        self._steps = None  # StepFunctions, once the models are built
        self._checkpoint = None
        self._pending_restore = None
        self._stop_request = StopRequest()  # SIGTERM while fit runs
        self.skipped_steps = 0
        self._fault_hook = None
        if all(model.built for model in self.models):
            self._build(None)

    @property
    def fault_hook(self):
        """None, or fn(step, phase) every training step calls (the class docstring)."""
        return self._fault_hook

    @fault_hook.setter
    def fault_hook(self, hook):
        if hook is not None and not callable(hook):
            raise TypeError(f"fault_hook must be None or a function (step, phase), got "
                            f"{type(hook).__name__} {hook!r}")
        self._fault_hook = hook

    def _build(self, x):
        """Builds towers, checkpoint and StepFunctions (returned); x builds unbuilt models."""
        self._steps, self._checkpoint = build_run(
            self.models, self.optimizers, self._options, (self._step, self._epoch_totals),
            x, f"bcast_period={self._bcast_period}", self._pending_restore)
        self._pending_restore = None
        return self._steps

    def _built(self, what):
        """The StepFunctions; ValueError naming ``what`` if no batch has built the models."""
        if self._steps is None:
            raise ValueError(f"{what}: the models are not built yet; train on a batch first")
        return self._steps

    def _built_steps(self, x):
        """The StepFunctions; batch x builds the models first if they are not built."""
        return self._steps or self._build(x)

    def _run_train_step(self, x, y):
        """One step of targets y (``batching.Weighted``): (mean loss, correct or None, stopping)."""
        if self._fault_hook is not None:
            self._fault_hook(self.step, "start")
        x, y, batch = worker_batch(
            x, y, self._cluster, len(self.devices), self._options.total_towers,
            self._options.class_indices,
            self._options.micro_batches // self._cluster.num_workers or None)
        check_batch_for_micro_batches(int(batch), self._options.micro_batches)
        loss, correct, stops, skipped = self._built_steps(x).train(
            x, y, batch, self._elastic.flag(self._stop_request.requested))
        stops = self._elastic.after_step(self, stops)  # commits, or leaves to re-form
        self.skipped_steps += int(skipped)
        if self._bcast_period and self.step % self._bcast_period == 0:
            self._steps.broadcast()
        correct = int(correct)  # negative: accuracy is not defined for the model's outputs
        if self._fault_hook is not None:
            self._fault_hook(self.step, "end")
        # Across workers the requests summed over the workers (the flags sent
        # into the step): all stop after the same step. One process also
        # stops for a request that came during the step.
        stopping = self._cluster.agreed(float(stops), self._stop_request.requested)
        return float(loss), (correct if correct >= 0 else None), stopping

    def train_step(self, x, y, sample_weight=None):
        """Trains on one global batch, split across the towers.

        Args:
          x: tf.Tensor or np.ndarray [batch, ...], the global batch's inputs,
            or a structure of them (as in `fit`).
          y: the targets [batch, ...] (e.g. int class labels), or a structure.
          sample_weight: None, or [batch] (or [batch, ...]) weights (as in `fit`).

        Returns:
          float, the mean loss over the global batch (plus regularisation),
          computed before the update.

        Raises:
          ValueError: two leaves disagree on the batch size (naming them), or
            the batch has fewer examples than there are towers (of all workers).
          tfreduce.WorkerLostError: in a cluster, a worker is lost.
        """
        return self._run_train_step(x, with_weights(y, sample_weight))[0]

    def broadcast(self):
        """Copies tower 0's model and optimizer variables to every tower.

        In a cluster, rank 0's tower 0 (and step counter) goes to every tower
        of every worker; call it on every worker at the same point.

        Raises:
          ValueError: the models are not built yet (no batch seen).
        """
        self._built("broadcast").broadcast()

    def fit(self, x, y=None, *, sample_weight=None, epochs=1, batch_size=32, shuffle=True,
            seed=0, validation_data=None, logdir=None, checkpoint_dir=None, callbacks=(),
            verbose=1, profile_steps=None, commit_every=None):
        """Trains until `epochs` epochs are done, counting restored ones.

        The epoch and batch to start from follow from the step counter, so
        after `restore` (or a previous `fit`) training continues where it
        stopped; with array input and the same arguments the result equals
        an uninterrupted run. Array input is reshuffled each epoch by a
        generator seeded with (seed, epoch); a last batch with fewer examples
        than towers is skipped in that epoch (its examples land in other
        batches in other epochs when shuffling). A dataset (or PyDataset) is
        iterated as given: finite, global batches of at least K examples,
        the same batches in every pass for an exact resume.

        Ctrl-C (KeyboardInterrupt) writes a checkpoint to `checkpoint_dir`
        (when given) and re-raises; SIGTERM does the same after the step in
        progress, raising `signals.Terminated`, on every worker at one step.

        In a cluster every worker calls fit with the same data and
        arguments; batches are global (split over all T = W * K towers), only
        rank 0 writes summaries and checkpoints and shows progress, and a
        successful fit ends with `Cluster.finish()` (waits for every worker).
        Under the elastic launcher (``--workers MIN:MAX``) fit commits and
        resumes itself as workers come and go (trainer/elastic.py).

        Args:
          x: np.ndarray [examples, ...] of inputs, or any structure of them
            Keras' fit takes (dicts, lists, tuples, nested: every leaf is
            split along axis 0); or a tf.data.Dataset or keras.utils.PyDataset
            of (x, y) or (x, y, sample_weight) global batches (trainer/batching.py).
          y: np.ndarray [examples, ...] of targets (or a structure the loss
            takes); None for a dataset.
          sample_weight: [examples] (or [examples, ...]) weights of each
            example's loss, as Keras' fit takes them; None: all 1.
          epochs: int, the epoch to train up to (total, not additional).
          batch_size: int >= T, global batch size for array input (T = K
            towers, times W workers in a cluster).
          shuffle: bool, reshuffle array input every epoch.
          seed: int, seed of the shuffling.
          validation_data: (x_val, y_val) or (x_val, y_val, weights) arrays,
            or a dataset of such batches, evaluated after every epoch.
          logdir: directory for TensorBoard summaries: per step loss,
            accuracy, learning rate, step time and who the others wait for
            (each tower's and worker's ms: towertimes, tfreduce.workers.stragglers);
            per epoch the epoch means, validation results and images/s.
            None: no summaries.
          checkpoint_dir: directory where a checkpoint is written after every
            epoch and on Ctrl-C (see `save`). None: no checkpoints.
          callbacks: functions fn(epoch, logs) called after every epoch with
            the 1-based epoch number and that epoch's dict of results,
            before its checkpoint is written.
          verbose: 0 silent; 1 a progress bar per epoch on a terminal, one line
            per epoch when stdout is a file or a pipe; 2 one line per epoch.
          profile_steps: None, or steps (a, b) (1-based, as Keras'
            profile_batch) to run under TF's profiler; writes
            logdir/timeline.json.gz (Chrome trace) and .png (trainer/profiling.py;
            a window the run does not reach: a UserWarning, no timeline).
          commit_every: None or int N >= 1: under the elastic launcher every
            worker commits after each N steps (and each epoch: None commits
            after epochs only); unused without it.

        Returns:
          dict of lists, one entry per epoch run by this call: "epoch",
          "loss", "accuracy" (when defined), "val_loss" and "val_accuracy"
          (with validation_data), "images_per_sec" (training images over
          the epoch's wall time, including the first step's tracing),
          "skipped_steps" (with on_nonfinite="skip", or when any was skipped).

        Raises:
          ValueError: bad arrays or dataset, batch_size smaller than T, an
            infinite dataset, verbose not 0, 1 or 2, bad profile_steps or
            commit_every (TypeError when not an int).
          KeyboardInterrupt: re-raised after the checkpoint is written.
        """
        hooks = FitHooks(
            run_step=self._run_train_step,
            stop=self._stop_request, epoch_totals=self._epoch_totals,
            reports_skipped=self._options.on_nonfinite == "skip", finish=self._cluster.finish,
            # The graphs once the first batch has built them (a model without an Input).
            graphs=lambda: self._steps.graphs(), rank=self._cluster.rank,
            tower_medians=lambda: self._steps.tower_times.medians(),
            watchdog=self._cluster.watchdog,
            commit=lambda: self._elastic.commit(self))
        with self._elastic.fitting(self, commit_every):
            return fit_loop(
                self, hooks, x, y, sample_weight, self._options.total_towers, epochs=epochs,
                batch_size=batch_size, shuffle=shuffle, seed=seed,
                validation_data=validation_data, logdir=logdir, checkpoint_dir=checkpoint_dir,
                callbacks=callbacks, verbose=verbose, profile_steps=profile_steps)

    def evaluate(self, x, y=None, batch_size=256, sample_weight=None):
        """Mean loss and accuracy over a dataset, each batch split across the towers.

        Args:
          x: as in `fit`.
          y: as in `fit`.
          batch_size: int, the global batch size of array input.
          sample_weight: as in `fit` (the loss is the weighted mean).

        Returns:
          dict: "loss" (float, mean per-example loss plus regularisation) and,
          for class scores against int or one-hot labels, "accuracy" (float).

        Raises:
          ValueError: bad arrays (empty, or x and y of different lengths).
        """
        batches = eval_batches(x, y, batch_size, "evaluate", sample_weight)
        return evaluate_loop(batches, self._built_steps, self.models[0])

    def predict(self, x, batch_size=256):
        """Model outputs for every example, each batch split across the towers.

        Args:
          x: as in `fit`, or a dataset of input batches (or (x, y) ones,
            whose y is ignored).
          batch_size: int, global batch size for array input.

        Returns:
          np.ndarray [examples, ...outputs] (the model's structure of them
          for several outputs), in input order.

        Raises:
          ValueError: x has no examples.
        """
        return predict_loop(input_batches(x, batch_size), self._built_steps)
