"""The MLflow answer-first figure and description: ``plot_curves`` draws every validated set with its CI band and the
training curves from a real MLflow store, and ``finish_run`` puts the run's report above the where-to-look note."""
from tasks import tracking


def _run(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    c = MlflowClient(tracking_uri=uri)
    run_id = c.create_run(c.create_experiment("e")).info.run_id
    c.set_tag(run_id, "mlflow.note.content", "where to look")
    for step in range(1, 5):
        m = {"reward/mean": 0.2 * step, "throughput/rollout_tokens_per_s": 100.0, "policy/entropy": 0.05,
             "mismatch/token_mult_prob_error": 1.002, "clip/lower_neg_adv_frac": 0.01}
        if step % 2 == 0:
            for name in ("main", "digits4"):
                m.update({f"val/{name}/accuracy": 0.1 * step, f"val/{name}/accuracy_lo": 0.05 * step,
                          f"val/{name}/accuracy_hi": min(1.0, 0.15 * step)})
        tracking.log_metrics(uri, run_id, m, step)
    return uri, run_id, c


def test_plot_curves_draws_the_sets_with_ci_bands(tmp_path, monkeypatch):
    uri, run_id, c = _run(tmp_path)
    drawn = {}
    real_client = tracking.client

    class Spy:  # the real client, with the figure's axes recorded on the way to MLflow
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def log_figure(self, run, fig, path):
            drawn["axes"] = [(ax.get_title(), [ln.get_label() for ln in ax.get_lines()], len(ax.collections))
                             for ax in fig.axes]
            return self.inner.log_figure(run, fig, path)

    monkeypatch.setattr(tracking, "client", lambda u: Spy(real_client(u)))
    assert tracking.plot_curves(uri, run_id) == "curves.png"
    titles = {t: (lines, bands) for t, lines, bands in drawn["axes"]}
    assert titles["validation accuracy (95% CI)"] == (["digits4", "main"], 2)  # one line and one band per set
    assert titles["reward"][0] == ["mean reward"] and titles["policy entropy"][0] == ["entropy (nats/token)"]
    assert titles["throughput (tokens/s)"][0] == ["rollout"]  # train throughput was not logged: not drawn
    assert "curves.png" in {f.path for f in c.list_artifacts(run_id)}


def test_finish_run_puts_the_report_first_and_replaces_it_on_resume(tmp_path):
    uri, run_id, c = _run(tmp_path)
    tracking.finish_run.fn(uri, run_id, status="FINISHED", summary={"x": 1}, plot=False, report="| first |")
    tracking.finish_run.fn(uri, run_id, status="FINISHED", summary={"x": 2}, plot=False, report="| second |")
    note = c.get_run(run_id).data.tags["mlflow.note.content"]
    assert note.startswith("| second |") and note.endswith("where to look") and "first" not in note
    assert c.get_run(run_id).info.status == "FINISHED"
