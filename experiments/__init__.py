"""Reference experiments as code (each a Prefect flow whose training runs are child MLflow runs of one parent)."""
