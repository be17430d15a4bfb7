"""Ray orchestration: Ray start-up and token auth, placement, actor start/stop and liveness, the driver's waits."""
