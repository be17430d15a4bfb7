"""Storage: checkpoints on local disk or s3:// (fsspec)."""
