"""Process infrastructure: Ray start-up and token auth, placement, actor start/stop and liveness, the run environment, the watchdog, quiet logging."""
