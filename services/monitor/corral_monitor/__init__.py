"""corral monitor: audit events into ClickHouse, detection rules, alerts on the bus."""
