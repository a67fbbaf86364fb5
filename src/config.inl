// config: implementation.
