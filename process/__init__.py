"""Process plumbing every room uses: the run's environment, quiet start-up, held stop signals, the watchdog, progress bars, and the TEST-ONLY hooks."""
