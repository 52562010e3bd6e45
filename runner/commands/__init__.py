"""CLI verbs, one module per area; each exposes register(subparsers)."""
