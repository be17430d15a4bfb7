"""MLflow links open the model-training view; experiments we create or reuse carry the model-training kind tag."""
from tasks.tracking import EXPERIMENT_KIND_TAG, experiment_id, ui_hint, ui_url


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
