"""What a trainer shows of itself: step, cluster, traces, replica drift, state, step graphs."""


class Inspection:
    """The inspection methods of ReplicatedTrainer (a base class of it).

    They read the trainer's built step functions through ``self._built(what)``,
    which ReplicatedTrainer defines: the StepFunctions, or a ValueError naming
    ``what`` when no batch has built the models yet; and its ``_step``
    counter and ``_cluster``.
    """

    @property
    def step(self):
        """int: the number of training steps taken so far."""
        return int(self._step.numpy())

    @property
    def cluster(self):
        """The started tfreduce.Cluster, or None in a single process."""
        return None if self._cluster.is_local else self._cluster

    @property
    def is_chief(self):
        """bool: rank 0 of the cluster, or True in a single process."""
        return self._cluster.is_chief

    def tracing_counts(self):
        """How many times each step function was traced: 1 each, unless inputs vary.

        Returns:
          dict {"train", "evaluate", "predict"} ("accumulate" too with
          accumulate_steps > 1) -> int; 0: not run yet; above 1: retraced.

        Raises:
          ValueError: the models are not built yet (no batch seen).
        """
        return self._built("tracing_counts").tracing_counts()

    def check_replicas(self):
        """Largest absolute difference between any tower's variable and tower 0's.

        Returns:
          float, max over towers k, model and optimizer variables n (with
          ZeRO, model variables only) and elements of
          |models[k] variable n - models[0] variable n|.

        Raises:
          ValueError: the models are not built yet (no batch seen).
        """
        return float(self._built("check_replicas").difference())

    def state_bytes(self):
        """The bytes of state each tower's device holds.

        Returns:
          list of K dicts of ints: tower k's "weights" (the model's variables,
          and the copy of its forward state a skipped step restores),
          "optimizer" (with ZeRO, also its pieces of the weights),
          "accumulation", "compression" (PowerSGD's) and "total".

        Raises:
          ValueError: the models are not built yet (no batch seen).
        """
        return self._built("state_bytes").state_bytes()

    def state_variables(self):
        """The variables each tower's device holds, by kind (what `state_bytes` counts).

        Returns:
          list of K dicts: tower k's "weights" (models[k].variables, then
          the copy of its forward state a skipped step restores),
          "optimizer" (optimizers[k].variables; with ZeRO, then its pieces
          of the weights, one per trainable variable), "accumulation" (the
          gradient sums of accumulate_steps > 1: one per trainable
          variable, or with zero_stage 2 one per shard) and
          "compression" (PowerSGD's Q and error feedback of each
          compressed variable, in that order), each a list of tf.Variable.

        Raises:
          ValueError: the models are not built yet (no batch seen).
        """
        return self._built("state_variables").state_variables()

    def step_graphs(self):
        """The graphs of the training step functions traced so far.

        To inspect what a step runs: its ops, their devices, the bytes
        that cross devices (`tfreduce.analyze_traffic`).

        Returns:
          dict: "train" (the step that reduces and applies) and, with
          accumulate_steps > 1, "accumulate" (a step between updates) ->
          tf.Graph; each present once a step of its kind has run.

        Raises:
          ValueError: the models are not built yet (no batch seen).
        """
        return self._built("step_graphs").step_graphs()
