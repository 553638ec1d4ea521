"""corral scheduler: places sandbox requests on node-agents."""
