"""Text stages: what a request's decode options do to its text (stop strings, logprobs)."""
