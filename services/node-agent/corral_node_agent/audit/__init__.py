"""What the node sees sandboxes do, and how it reaches the audit stream.

- seccomp.py: denied and watched syscalls (seccomp user notifications);
- fanotify.py: protected paths and canaries (fanotify permission events);
- files.py: general file activity (fanotify notification events);
- reader.py: the one read loop of the fanotify groups of both;
- log.py: the per-node buffer that publishes AuditEvents to CORRAL_AUDIT;
- limits.py: OOM kills and pids-limit hits, read from cgroup counters;
- wiring.py: the sources started for the node, their callbacks turned into AuditEvents, and
  what a sandbox's create, exec and destroy start and stop."""
