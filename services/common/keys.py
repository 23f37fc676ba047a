"""Redis key names of one run, in one place."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunKeys:
    """Every Redis key a run uses is `dapo:<run>:...`, so runs can share a Redis."""

    run: str

    def _key(self, *parts: str) -> str:
        return ":".join(("dapo", self.run, *parts))

    @property
    def scored(self) -> str:
        """Stream of every scored group (controller → buffer)."""
        return self._key("scored")

    @property
    def train(self) -> str:
        """Stream of informative, fresh groups (buffer → learner)."""
        return self._key("train")

    @property
    def version(self) -> str:
        """The learner's latest committed policy version."""
        return self._key("version")

    @property
    def ledger(self) -> str:
        """Hash of counters: admitted, scored, filtered:<reason>, trained, ..."""
        return self._key("ledger")

    @property
    def pass_rates(self) -> str:
        """Hash prompt_id → recent pass rates (buffer → controller)."""
        return self._key("pass_rates")

    @property
    def done(self) -> str:
        """Set when the learner finished its last step; every service then exits."""
        return self._key("done")

    @property
    def metrics(self) -> str:
        """Stream of per-step learner metrics (JSON), for progress bars and reports."""
        return self._key("metrics")

    @property
    def steps(self) -> str:
        """Stream of committed steps: each one's step, version, group ids and entry ids.

        Written in the step's commit; a step redone after a learner restart appears again,
        and the last record of a step is the one in the model.
        """
        return self._key("steps")

    @property
    def evals(self) -> str:
        """Stream of in-run held-out evaluations (JSON), one per eval point (controller)."""
        return self._key("evals")

    @property
    def eval_hold(self) -> str:
        """The version whose eval point the learner waits for before its next step, and
        for how long at most (JSON; controller → learner, `controller.eval.hold_learner`)."""
        return self._key("eval_hold")

    @property
    def cursor(self) -> str:
        """The controller's position in the prompt stream (epoch:index)."""
        return self._key("cursor")

    @property
    def generating(self) -> str:
        """Stream, one entry per group waiting for or in GenerateGroup: its length is the
        generation backlog that KEDA scales rollout servers on (deploy/k8s/autoscaling)."""
        return self._key("generating")

    @property
    def inflight(self) -> str:
        """Hash group_id → prompt of groups admitted but not yet in `scored`."""
        return self._key("inflight")

    @property
    def rejected(self) -> str:
        """Stream of rejected groups (capped): group id, prompt id, reason and the server's
        words; the counts are the ledger's `rejected:<reason>` (controller)."""
        return self._key("rejected")

    @property
    def dataset(self) -> str:
        """Hash of the training data as loaded: rows, usable, filtered:<reason> (controller)."""
        return self._key("dataset")

    @property
    def failed(self) -> str:
        """Set (a one-line reason) when a service sees the run cannot make progress;
        `dapo up` stops with a non-zero exit and that line."""
        return self._key("failed")

    @property
    def run_id(self) -> str:
        """The id of the run that owns this key space (`dapo up` sets it at its first
        start; a second run with the same run_name is refused, a learner checks its
        checkpoints against it)."""
        return self._key("run_id")

    def registry(self, role: str) -> str:
        """Key prefix of live instances of a role (each key has a heartbeat TTL)."""
        return self._key("registry", role)
