"""corral's SandboxFusion-compatible HTTP gateway: `POST /run_code` (and the health check its
clients use) translated into one-shot runs on the bus, so code written against a SandboxFusion
server (verl's sandbox_fusion reward, the `sandbox-fusion` client) runs on corral unchanged."""
