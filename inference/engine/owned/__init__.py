"""The engine loop Ceiling owns: decode steps run by our code, not by transformers' manager.

The shape is nano-vllm's, one short file per part:

- sequence.py — one request as the loop sees it: its tokens, its KV blocks, how far it got.
- blocks.py   — the paged KV cache's bookkeeping: free blocks, reference counts, and prefix
                sharing by a hash chain over full blocks.
- scheduler.py — which tokens the next step computes: every running request's next token, then
                prompt chunks up to the step's token budget (chunked prefill).
- runner.py   — the model's forward pass over one step, written here against the weights of
                transformers' modules: RMSNorm, the projections (whatever variant they were
                patched into), rotary embeddings, KV written into and read from the paged cache.
- manager.py  — the thread that runs steps and the interface the Engine drives (the same one it
                drives transformers' ContinuousBatchingManager with).

transformers still loads the model, its weights and its tokenizer; only the hot loop is ours.
"""
