"""e2e: the local stack runs `prefect deployment run fp8-grpo/fp8-grpo` on a 2-step override; the MLflow server's REST
API then shows the run with mismatch and throughput metrics, the checkpoint is in a moto S3 bucket (written through a
proxy that injects transient 503s, which are retried), and the S3 credentials appear nowhere in MLflow or in the
flow run's logs. The stack fixture stops the stack afterwards and checks nothing is left running."""

from __future__ import annotations

import json
import urllib.parse
import uuid

import pytest
from _ops import BUCKET, PREFECT, TINY, rest, run_logged, s3_client
from _runs import check_refits_and_mismatch

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _mlflow_run_by_name(base: str, experiment: str, run_name: str) -> dict:
    exp = rest(f"{base}/api/2.0/mlflow/experiments/get-by-name?" + urllib.parse.urlencode(
        {"experiment_name": experiment}))["experiment"]
    runs = rest(f"{base}/api/2.0/mlflow/runs/search", {
        "experiment_ids": [exp["experiment_id"]], "filter": f"tags.`mlflow.runName` = '{run_name}'"}).get("runs", [])
    assert len(runs) == 1, f"expected one MLflow run named {run_name}, got {len(runs)}"
    return runs[0]


def test_stack_status_reports_all_services(stack):
    from _ops import stack_cmd

    r = stack_cmd(stack["run_dir"], "status", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    st = json.loads(r.stdout)
    for name in ("mlflow", "prefect-server", "worker"):
        assert st["services"][name]["running"] and st["services"][name]["healthy"], st
    assert st["prefect_api_url"].startswith("http://127.0.0.1:") and st["mlflow_url"].startswith("http://127.0.0.1:")
    # flow runs inherit the worker's environment: Ray token auth with the stack's 0600 token file
    from _ops import proc_env

    token = stack["run_dir"] / "ray_auth_token"
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) == 64
    worker_env = proc_env(st["services"]["worker"]["pid"])
    assert worker_env.get("RAY_AUTH_MODE") == "token" and worker_env.get("RAY_AUTH_TOKEN_PATH") == str(token)
    deployments = rest(f"{stack['prefect_api_url']}/deployments/filter", {})
    names = {d["name"]: d for d in deployments}
    assert {"fp8-grpo", "nightly-regression"} <= set(names)
    nightly = names["nightly-regression"]
    assert [(s["schedule"].get("cron"), s["schedule"].get("timezone")) for s in nightly["schedules"]] == \
        [("0 3 * * *", "UTC")]


def test_deployment_run_two_steps_to_mlflow_and_s3(stack, moto, faulty_s3, s3_credentials, tmp_path):
    proxy = faulty_s3(patterns=("manifest.json", "model.safetensors"), fail_first=1)
    tag = uuid.uuid4().hex[:8]
    run_name, prefix = f"ops-deploy-{tag}", f"deploy-{tag}"
    overrides = [*TINY, f"run_dir={tmp_path / 'run'}", f"logger.mlflow.run_name={run_name}",
                 f"checkpointing.checkpoint_dir=s3://{BUCKET}/{prefix}", f"checkpointing.s3_endpoint_url={proxy.url}"]
    params = {"config_path": "configs/tiny_fp8_e2e.yaml", "overrides": overrides}
    flow_run_name = f"ops-{tag}"
    r = run_logged([PREFECT, "deployment", "run", "fp8-grpo/fp8-grpo",
                    "--params", json.dumps(params), "--flow-run-name", flow_run_name, "--watch",
                    "--watch-timeout", "480"], env=stack["env"], timeout=540)
    assert r.returncode == 0, f"deployment run failed:\n{r.stdout}\n{r.stderr}"

    # MLflow server REST API: the run, FINISHED, with mismatch + throughput metrics at steps 1 and 2.
    base = stack["mlflow_url"]
    run = _mlflow_run_by_name(base, "fp8-grpo", run_name)
    assert run["info"]["status"] == "FINISHED"
    run_id = run["info"]["run_id"]
    metrics = {m["key"] for m in run["data"]["metrics"]}
    assert "mismatch/token_mult_prob_error" in metrics
    throughput = {k for k in metrics if k.startswith("throughput/")}
    assert {"throughput/rollout_tokens_per_s", "throughput/train_tokens_per_s"} <= throughput, throughput
    hist = rest(f"{base}/api/2.0/mlflow/metrics/get-history?" + urllib.parse.urlencode(
        {"run_id": run_id, "metric_key": "mismatch/token_mult_prob_error"}))["metrics"]
    assert sorted(m["step"] for m in hist) == [1, 2] and all(m["value"] >= 1.0 for m in hist)
    from mlflow.tracking import MlflowClient

    check_refits_and_mismatch(MlflowClient(tracking_uri=base), run_id)  # through the tracking server
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert tags["precision"] == "fp8-e2e"

    # The checkpoint is in the moto bucket, complete (manifest lists every file with its size).
    s3 = s3_client(moto)
    keys = {o["Key"]: o["Size"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]}
    manifest = json.loads(s3.get_object(Bucket=BUCKET, Key=f"{prefix}/step_000002/manifest.json")["Body"].read())
    for name, meta in manifest["files"].items():
        assert keys[f"{prefix}/step_000002/{name}"] == meta["size"], name
    assert "model.safetensors" in manifest["files"]
    assert proxy.injected, "the proxy injected no transient error: the retry path was not exercised"
    print(f"injected transient S3 errors (retried): {len(proxy.injected)}: {sorted(set(proxy.injected))}")

    # Credentials never reach MLflow (params, tags, text artifacts) nor the flow run's Prefect logs.
    secrets_ = [s3_credentials["AWS_SECRET_ACCESS_KEY"], s3_credentials["AWS_ACCESS_KEY_ID"],
                (stack["run_dir"] / "ray_auth_token").read_text()]  # and the Ray token
    blob = json.dumps(run)
    arts = rest(f"{base}/api/2.0/mlflow/artifacts/list?" + urllib.parse.urlencode({"run_id": run_id}))
    for f in arts.get("files", []):
        if not f["is_dir"] and f["path"].endswith((".json", ".yaml", ".txt")):
            blob += _artifact_text(base, run_id, f["path"])
    flow_runs = rest(f"{stack['prefect_api_url']}/flow_runs/filter",
                     {"flow_runs": {"name": {"any_": [flow_run_name]}}})
    assert len(flow_runs) == 1 and flow_runs[0]["state_type"] == "COMPLETED"
    # the run's report, a markdown artifact of the flow run: accuracy start -> end, mismatch, the MLflow link
    artifacts = rest(f"{stack['prefect_api_url']}/artifacts/filter",
                     {"artifacts": {"flow_run_id": {"any_": [flow_runs[0]["id"]]}}})
    reports = [a for a in artifacts if a["type"] == "markdown" and a["key"] == "fp8-grpo-tiny-fp8-e2e"]
    assert len(reports) == 1, artifacts
    assert "validation accuracy (greedy, 95% CI)" in reports[0]["data"] and run_id in reports[0]["data"]
    assert "| steps | 1-2 (2 run) of 2 |" in reports[0]["data"]
    logs = rest(f"{stack['prefect_api_url']}/logs/filter",
                {"logs": {"flow_run_id": {"any_": [flow_runs[0]["id"]]}}, "limit": 200})
    blob += json.dumps(logs) + json.dumps(flow_runs[0]["parameters"])
    assert "config.resolved.yaml" in blob or any("config" in f["path"] for f in arts.get("files", []))
    for s in secrets_:
        assert s not in blob, "S3 credential or Ray token leaked into MLflow or Prefect logs"


def _artifact_text(base: str, run_id: str, path: str) -> str:
    import urllib.request

    url = f"{base}/get-artifact?" + urllib.parse.urlencode({"path": path, "run_uuid": run_id})
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode(errors="replace")
