"""TEST-ONLY hooks: fault injection and gradient recording, kept out of the product classes.

The recipe's ``testing.*`` keys (configs/sections.py ``TestingCfg``) are read in one place, :meth:`TestHooks.from_config`,
which returns None when none is set: a real run has no hooks object at all, and the workers and tasks only call a
hook when theirs is not None.

* Worker kills (``testing.fault_kill_rollout_at_step`` / ``testing.fault_kill_policy_at_step``): the worker-loss
  tests need a worker process to die by SIGKILL at a known point of a known step, as it would from the OOM killer or
  a lost node. The step's task claims the kill (:meth:`TestHooks.kill_due`: a marker file under the run dir makes
  each kill happen once per run dir, so a retried step or a resumed run goes past it) and arms it on the actor
  (:func:`arm_kill`, through Ray's ``__ray_call__``); the actor's hooks SIGKILL its process at that point (the
  engine after generating, before returning, or in a refit over the refit group, after its first tensor arrived;
  the trainer at the start of its update).
* Validation degraded by ``testing.fault_val_accuracy_drop`` (:meth:`TestHooks.degraded`): the nightly
  regression's tests show that its verdict fails a degraded FP8 run.
* A skipped refit (``testing.fault_skip_refit_at_step``, :meth:`TestHooks.skip_refit`): the engines keep their
  weights at that step's refit, as an engine that silently missed one would; the end-to-end tests' negative control
  (the step's rollout must refuse to run on stale weights).
* Gradient recording (:attr:`TestHooks.record_gradients`): the data-parallel equivalence tests install hooks on the
  trainer actors and compare each update's full gradients between 1 and M workers.
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path


def claim_once(marker_dir: str | Path, what: str, step: int) -> bool:
    """True the first time ``(what, step)`` is claimed under ``marker_dir`` (an O_EXCL marker file), else False."""
    d = Path(marker_dir) / "faults"
    d.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(d / f"{what}_step_{step:06d}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return False
    return True


def kill_self() -> None:
    """SIGKILL this process: no cleanup, no exception, no reply -- what the caller sees of a crashed worker."""
    os.kill(os.getpid(), signal.SIGKILL)


class TestHooks:
    """The hooks of one process (a worker actor, or the flow's tasks); see the module docstring."""

    __test__ = False  # not a pytest class

    def __init__(self, *, kill_rollout_at_step: int = 0, kill_policy_at_step: int = 0, val_accuracy_drop: float = 0.0,
                 marker_dir: str = "", record_gradients: bool = False, skip_refit_at_step: int = 0):
        self.kill_rollout_at_step = kill_rollout_at_step
        self.skip_refit_at_step = skip_refit_at_step
        self.kill_policy_at_step = kill_policy_at_step
        self.val_accuracy_drop = val_accuracy_drop
        self.marker_dir = str(marker_dir)
        self.record_gradients = record_gradients
        self.recorded_updates: list[dict] = []  # full gradients of each update of the last step (before clipping)
        self._armed = False

    @classmethod
    def from_config(cls, cfg, run_dir: str | Path | None) -> TestHooks | None:
        """The hooks the recipe's ``testing.*`` keys ask for, or None (every key at its default: a real run)."""
        t = cfg.testing
        if not (t.fault_kill_rollout_at_step or t.fault_kill_policy_at_step or t.fault_val_accuracy_drop
                or t.fault_skip_refit_at_step):
            return None
        return cls(kill_rollout_at_step=t.fault_kill_rollout_at_step, kill_policy_at_step=t.fault_kill_policy_at_step,
                   val_accuracy_drop=t.fault_val_accuracy_drop, marker_dir=str(run_dir or ""),
                   skip_refit_at_step=t.fault_skip_refit_at_step)

    # -- startup -----------------------------------------------------------------------------------------------------
    def announcements(self) -> list[str]:
        """One loud line per fault this run will inject (printed at the start of the run)."""
        out = [f"TEST-ONLY FAULT: testing.{key}={at}: a worker process will be SIGKILLed (a test of worker-loss "
               "handling; never use it in a real run)"
               for key, at in (("fault_kill_rollout_at_step", self.kill_rollout_at_step),
                               ("fault_kill_policy_at_step", self.kill_policy_at_step)) if at]
        if self.skip_refit_at_step:
            out.append(f"TEST-ONLY FAULT: testing.fault_skip_refit_at_step={self.skip_refit_at_step}: the rollout "
                       "engines will ignore that step's refit (a test of the missed-refit guard; never use it in a "
                       "real run)")
        if self.val_accuracy_drop:
            out.append(f"TEST-ONLY FAULT: testing.fault_val_accuracy_drop={self.val_accuracy_drop}: validation "
                       "accuracy is deliberately degraded (a test of the regression verdict; never use it in a real "
                       "run)")
        return out

    # -- worker kills ------------------------------------------------------------------------------------------------
    def kill_due(self, what: str, step: int) -> bool:
        """A ``kill_rollout`` / ``kill_policy`` kill is due at ``step`` (its ``testing.fault_kill_*_at_step``, >= 1;
        0 = off, also for the step-0 rollout of the initial KV calibration) and not done before in this run dir."""
        at = self.kill_rollout_at_step if what == "kill_rollout" else self.kill_policy_at_step
        return at >= 1 and at == step and claim_once(self.marker_dir, what, step)

    def arm(self) -> None:
        """The next kill point of this process (:meth:`kill_point`) SIGKILLs it."""
        self._armed = True

    def kill_point(self) -> None:
        """Called by the worker where a crash is to be simulated; dies if armed."""
        if self._armed:
            kill_self()

    # -- refits -----------------------------------------------------------------------------------------------------
    def skip_refit(self, weights_version: int | None) -> bool:
        """The refit of these weights is to be ignored: they are the policy of step ``weights_version``, loaded at
        the refit of step ``weights_version + 1`` (the step of ``testing.fault_skip_refit_at_step``)."""
        return self.skip_refit_at_step >= 1 and weights_version == self.skip_refit_at_step - 1

    # -- validation --------------------------------------------------------------------------------------------------
    def degraded(self, correct: list[bool], seed: int) -> set[int]:
        """Indices of round(val_accuracy_drop * len) correct answers to turn wrong (chosen with ``seed``)."""
        if not self.val_accuracy_drop:
            return set()
        right = [i for i, c in enumerate(correct) if c]
        return set(random.Random(seed).sample(right, min(len(right), round(self.val_accuracy_drop * len(correct)))))

    def degrade(self, records: list[dict], seed: int) -> list[dict]:
        """Validation records (each with ``correct``) with the :meth:`degraded` ones turned wrong and marked
        ``fault``: what tasks.context.RunContext hands the validation task's records through in a faulted run."""
        faulty = self.degraded([r["correct"] for r in records], seed)
        return [{**r, "correct": False, "fault": True} if i in faulty else r for i, r in enumerate(records)]

    # -- gradients ---------------------------------------------------------------------------------------------------
    def on_gradients(self, update: int, grads) -> None:
        """Keep the full gradients of ``update`` (0 = the step's first; a new step starts a new list) when recording.
        ``grads``: a callable returning ``{name: tensor}`` (only called when recording)."""
        if self.record_gradients:
            self.recorded_updates = [*(self.recorded_updates if update else []), grads()]

    @property
    def recorded_gradients(self) -> dict:
        """The first update's gradients of the last step."""
        return self.recorded_updates[0] if self.recorded_updates else {}


def arm_kill(worker) -> None:
    """Run on a worker actor (``actor.__ray_call__.remote(arm_kill)``): its hooks kill it at its next kill point."""
    worker.hooks.arm()
