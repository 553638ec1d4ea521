"""The handlers that stage and commit the monitor's two streams into ClickHouse, for
`corral_monitor.pull.PullConsumer`: `AuditIngest` (CORRAL_AUDIT: decode, dedup, rules, insert) and
`EventIngest` (CORRAL_EVENTS: sandbox and node lifecycle)."""
from .audit import AuditIngest
from .events import EventIngest
from .fault import Fault

__all__ = ["AuditIngest", "EventIngest", "Fault"]
