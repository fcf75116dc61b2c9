"""Staff dashboard and the end user's usage page, one module per area:

- overview.py: the overview and the live charts (pushed over /ws/dashboard/)
- config.py: users and quotas, defaults, features, providers, prices, audit trail
- teams.py: teams, their members and caps
- keys.py: an API key's own caps (its owner lowers them, staff set them)
- logs.py: cost per user (the long tail), the token log browser with CSV export, "my usage"
- batches.py: batch jobs of batch-mode features: start one, watch its progress, read its outputs
"""
