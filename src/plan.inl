// plan: implementation.
