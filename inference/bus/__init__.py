"""Side channels between web processes and workers, all through Redis, one module per role.

- clients.py: every Redis client of these modules, each with a named timeout policy.
- cancel.py: a web process publishes a request id; every worker cancels it within one step.
- stats.py: each worker's engine stats under its own key with a TTL, which is also its heartbeat.
- ownership.py: which worker runs a request, for which inbox, and how many tokens it has streamed,
  so a web process that hears nothing, or a live worker's sweep (inference/worker/lost.py), can tell
  a dead worker from a slow one.
- outbox.py: the worker side of streaming: frames bundled per engine step, one push per inbox.
- inbox.py: the web side of streaming: one Redis list per event loop, frames sorted out by request.

The channel layer remains for the staff dashboards' groups (outbox.ChannelSender.group_send).
"""
