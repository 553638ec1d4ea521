"""The node-agent's request handlers, one module per concern: create.py (single creates),
batch.py (a scheduler's batch, through the same create), run.py (one-shot runs), exec.py (one
exec), traj.py (trajectories, and replay wrapping exec), ops.py (a sandbox's operations)."""
