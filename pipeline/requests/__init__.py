"""A request's way through the processor besides its decode: sequencing, outcomes, failures,
expiry (`pipeline.processor` drives them)."""
