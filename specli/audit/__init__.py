"""The audit's wing: observing and blocking network use, what `specli audit` relies on.

Two processes: the auditor (`Auditor`, in `specli audit`) and the audited (`python -I -S
specli/audit/_site/boot.py`, which runs the generation). Four layers, each covering what the
others cannot:

- isolation: the audited process moves into a new network namespace whose only interface is a
  downed loopback before anything else runs in it, so any attempt, by anyone in its tree,
  fails by construction (ENETUNREACH). This is what makes a clean verdict a proof.
- the seccomp listener (`Supervisor`): every connect, addressed sendto, sendmsg and sendmmsg of
  the tree, C code and raw syscalls included, waits in the auditor until its destination is
  recorded. Isolated or not, this is what reports what was tried.
- the recorder (`_site/`): a `sys.addaudithook` hook in the audited process (before
  site) and, through PYTHONPATH, in Python children: who in Python made a call, DNS lookups
  through Python, process starts, and how each call ended.
- a /proc poller: the sockets the tree holds, read from /proc/PID/fd and /proc/PID/net/*
  every `interval`: listeners, and a cross-check of the other layers.

One module a job: `events` (what is recorded, and its scope), `poller` (/proc),
`tracee` (a watched thread's memory and descriptors), `supervisor` (the seccomp listener),
`proxy` (the isolated tree's calls, made by the auditor), `isolation` (the namespace),
`environment` (the environment's code and variables), `auditor` (the two processes and the
layers around them), `verdict` (the account, and whether it is a proof); `_site/` is the
recorder and the audited process's start, standard library only. Nothing here prints; the
CLI (specli/cli/audit.py) reports. This face imports nothing: import the module you need.
Linux only (/proc, namespaces, seccomp).
"""
