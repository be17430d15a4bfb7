"""Data: loading prompt datasets (jsonl / parquet, local or s3://) and the evaluation sets."""
