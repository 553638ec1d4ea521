"""corral node-agent: runs sandboxes on one node behind the substrate interface."""
