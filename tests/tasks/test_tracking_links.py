"""MLflow links open the model-training view; experiments we create or reuse carry the model-training kind tag."""
import pytest

from tasks.tracking import EXPERIMENT_KIND_TAG, artifact_location, experiment_id, ui_hint, ui_url


def test_links_carry_the_workflow_type():
    url = ui_url("sqlite:////x/mlflow.db", "3", "abc")
    assert url == "http://127.0.0.1:5000/#/experiments/3/runs/abc/model-metrics?workflowType=machine_learning"
    assert ui_url("http://127.0.0.1:5123/", "3") == \
        "http://127.0.0.1:5123/#/experiments/3/runs?workflowType=machine_learning"
    assert ui_url(None, "3") is None and ui_hint("http://h:5000") == ""
    assert ui_hint("sqlite:////x/mlflow.db").endswith("--backend-store-uri sqlite:////x/mlflow.db")


def test_the_ui_reads_the_parameter():
    """The link relies on MLflow 3.17's UI reading ``workflowType`` from the URL (values genai / machine_learning)."""
    from pathlib import Path

    import mlflow

    js = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    text = "".join(p.read_text(errors="ignore") for p in js.glob("main.*.js"))
    assert 'get("workflowType")' in text and 'MACHINE_LEARNING="machine_learning"' in text
    assert '"mlflow.experimentKind"' in text and 'CUSTOM_MODEL_DEVELOPMENT="custom_model_development"' in text


def test_experiments_are_tagged_model_training(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = MlflowClient(tracking_uri=uri)
    new = experiment_id(c, "fresh")
    assert c.get_experiment(new).tags[EXPERIMENT_KIND_TAG[0]] == EXPERIMENT_KIND_TAG[1]
    old = c.create_experiment("older")  # created before the tag existed: tagged on reuse
    assert experiment_id(c, "older") == old and c.get_experiment(old).tags[EXPERIMENT_KIND_TAG[0]] == EXPERIMENT_KIND_TAG[1]
    mine = c.create_experiment("genai", tags={EXPERIMENT_KIND_TAG[0]: "genai_development"})
    experiment_id(c, "genai")  # a user's explicit choice is kept
    assert c.get_experiment(mine).tags[EXPERIMENT_KIND_TAG[0]] == "genai_development"


def test_a_fault_run_is_tagged_and_a_real_run_is_not(tmp_path):
    """A TEST-ONLY fault run carries the ``testing.fault`` tag naming its faults (configs/sections.py TestingCfg)."""
    from mlflow.tracking import MlflowClient

    from configs.schema import load_config
    from tasks.tracking import start_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    real = start_run(load_config("configs/tiny_fp8_e2e.yaml", []), uri)
    fault = start_run(load_config("configs/tiny_fp8_e2e.yaml", ["testing.fault_val_accuracy_drop=0.1"]), uri)
    c = MlflowClient(tracking_uri=uri)
    assert "testing.fault" not in c.get_run(real).data.tags
    assert c.get_run(fault).data.tags["testing.fault"] == "testing.fault_val_accuracy_drop=0.1"


def test_artifacts_of_a_sqlite_store_stay_next_to_its_database(tmp_path, monkeypatch):
    """Not ./mlruns of the working directory (MLflow's default), which every database would share."""
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    (tmp_path / "store").mkdir()
    c = MlflowClient(tracking_uri=uri)
    run = c.create_run(experiment_id(c, "e")).info.run_id
    c.log_text(run, "x", "note.txt")
    assert (tmp_path / "store" / "mlartifacts").is_dir() and not (tmp_path / "mlruns").exists()
    assert c.download_artifacts(run, "note.txt", str(tmp_path)) and (tmp_path / "note.txt").read_text() == "x"
    assert artifact_location("sqlite:///rel/mlflow.db") == (tmp_path / "rel" / "mlartifacts").as_uri()  # resolved
    assert artifact_location("http://127.0.0.1:5000") is None  # a tracking server keeps its own artifact root


def test_a_stop_signal_during_a_database_write_waits_for_it(tmp_path):
    """A SIGTERM that lands inside a write to a sqlite store (as one did in the SIGTERM e2e test: inside the
    checkpoint task's MLflow write) is delivered when the write is done, so the transaction commits instead of
    staying open and locking the database against the run's final KILLED status."""
    import os
    import signal

    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    from tasks.tracking import client

    class Stop(BaseException):
        pass

    def stop(signum, frame):
        raise Stop

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = client(uri)
    run = c.create_run(experiment_id(c, "e")).info.run_id
    real = SqlAlchemyStore.set_tag

    def set_tag_hit_by_a_signal(self, run_id, tag):  # the signal arrives while the write is under way
        os.kill(os.getpid(), signal.SIGTERM)
        return real(self, run_id, tag)

    old = signal.signal(signal.SIGTERM, stop)
    try:
        SqlAlchemyStore.set_tag = set_tag_hit_by_a_signal
        with pytest.raises(Stop):
            c.set_tag(run, "k", "v")
    finally:
        SqlAlchemyStore.set_tag = real
        signal.signal(signal.SIGTERM, old)
    assert c.get_run(run).data.tags["k"] == "v"  # the write completed before the handler ran
    c.set_terminated(run, status="KILLED")  # and the store is not locked afterwards
    assert c.get_run(run).info.status == "KILLED"
