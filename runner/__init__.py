"""runner: config-as-data LLM pretraining experiments with provable token accounting."""

__version__ = "0.1.0"
