"""What at least two corral services share: the v1 bus contract, subjects, config, bus helpers."""
