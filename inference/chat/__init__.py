"""One chat request, from a parsed frame to its last event: the same pipeline for the websocket
(inference/consumers.py) and the OpenAI-compatible HTTP API (inference/api.py).

Read it in the order a request goes through it; each stage is a module with one job, and each only
imports the stages before it:

    parse     inference/web/frames.py (the socket's frame), inference/api.py (an HTTP body)
    route     route.py     which feature serves it, and what its mode adds to the stages below
    checks    checks.py    before the guard: the mode's prompt (passages, the JSON instruction),
                           the feature switched on, its weights served, the input's size and tokens
    cache     cache.py     an answer already given to this question, free
    admit     admit.py     the budget guard: every ceiling at once, with the feature's fallback
    dispatch  dispatch.py  the Celery task on the queue of the weights that serve it
    relay     relay.py     the worker's frames as events, within the timeouts, recovered from the
                           ledger when frames are lost or the worker dies
    settle    settle.py    what this process settles itself: a request that never reached a worker,
                           timed out, or was abandoned while the guard decided

pipeline.py strings them together (`run_chat`); events.py holds the event shapes they share.
"""
