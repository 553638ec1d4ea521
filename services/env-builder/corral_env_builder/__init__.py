"""The env-builder service: builds RL environments from EnvSpecs, verifies them, keeps a versioned
catalog in NATS KV and grades rollouts with hidden tests the agent never had."""
