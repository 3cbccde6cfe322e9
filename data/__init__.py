"""The harvest stage: prompts -> target -> feature store."""
